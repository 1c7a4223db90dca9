import os
import sys

# Make the repo importable when the tests run without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
