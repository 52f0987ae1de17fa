"""The README's walkthrough, run as written: every shell line, Python block and config file
between `<!-- walkthrough -->` and `<!-- /walkthrough -->`, in order, in one bash session in
an empty directory (the `ckptd` and `python` of this environment first on PATH)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def walkthrough_script(readme: str) -> str:
    """The walkthrough as one bash script: sh blocks as they are, python blocks through the
    interpreter, `# file: NAME` toml blocks written to NAME."""
    part = readme.split("<!-- walkthrough -->", 1)[1].split("<!-- /walkthrough -->", 1)[0]
    out = ["set -euo pipefail",
           "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]  # a failed step leaves no daemon
    for lang, body in _BLOCK.findall(part):
        if lang == "sh":
            out.append(body)
        elif lang == "python":
            out.append(f"python - <<'CKPTD_PY'\n{body}CKPTD_PY")
        elif lang == "toml":
            first = body.splitlines()[0]
            assert first.startswith("# file: "), f"a toml block names its file: {first!r}"
            out.append(f"cat > {first[len('# file: '):].strip()} <<'CKPTD_TOML'\n{body}"
                       "CKPTD_TOML")
        else:
            raise AssertionError(f"a walkthrough block the test cannot run: {lang}")
    return "\n".join(out) + "\n"


def test_the_readme_walkthrough_runs_as_written(short_dir: Path) -> None:
    script = walkthrough_script((REPO / "README.md").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(short_dir)  # nothing of the user's own setup
    done = subprocess.run(["bash", "-c", script], cwd=short_dir, env=env, capture_output=True,
                          text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}\n" + _logs(short_dir)
    assert "Traceback" not in done.stderr, done.stderr
    # 1: nothing deleted until `prune --apply`, then exactly what keep_last = 2 drops
    listings = re.findall(r"^(model_step_\d+\.pt(?:\n model_step_\d+\.pt)*)", out, re.M)
    assert "adopted" in out and "--apply" in out
    assert sorted(p.name for p in (short_dir / "runs" / "existing").glob("*.pt")) == [
        "model_step_300.pt", "model_step_400.pt"], listings
    # 2: uploaded and named latest in the remote tier
    assert "new step 300 uploaded" in out and re.search(r"new step 300 .*remote=uploaded", out)
    # 3: resumed on the fresh node from the remote copy
    assert "resumed at step 300" in out
    assert not (short_dir / "fresh-node" / "runs" / "new" / "step-300").exists()


def _logs(d: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in d.rglob("ckptd.log"))
