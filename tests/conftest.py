import sys
from pathlib import Path

# The repository root, so tests import model/, data/ and launch/ as the scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
