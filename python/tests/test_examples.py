"""The README's Python example is a file; this runs it as written (twice on
one pool: the second run finds its blocks already stored) and checks the
README shows that file, not something that drifted from it."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
QUICKSTART = os.path.join(ROOT, "python", "examples", "quickstart.py")


def test_the_readme_quickstart_runs_as_written(tmp_path):
    for _ in range(2):
        p = subprocess.run([sys.executable, QUICKSTART, str(tmp_path / "pool")],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "restored 4 blocks x 4 layers" in p.stdout and "bytes equal" in p.stdout


def test_the_readme_shows_the_quickstart_file():
    with open(QUICKSTART) as f:
        code = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "```python\n" + code + "```" in readme
