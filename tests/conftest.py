import sys
from pathlib import Path

# Let the helpers module be imported by the tests (tests/ has no __init__.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))
