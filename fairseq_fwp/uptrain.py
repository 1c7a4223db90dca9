"""``python -m fairseq_fwp.uptrain``: the uptraining command (fairseq_fwp/uptraining/cli.py)."""
from .uptraining.cli import main

if __name__ == "__main__":
    main()
