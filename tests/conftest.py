import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Hypothesis keeps examples and constants in ./.hypothesis unless told otherwise; the suite must leave the working
# tree as it found it, so it keeps nothing between runs and writes its scratch files to a temporary directory.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="kvlab-hypothesis-"))

from hypothesis import settings  # noqa: E402

settings.register_profile("kvlab", database=None)
settings.load_profile("kvlab")
