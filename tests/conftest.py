import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repo (tests run without `pip install -e .`) and the quickstart pipeline.
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "quickstart"))
