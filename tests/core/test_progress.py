"""Progress on stderr (multihead._progress): a bar in a terminal, nothing when piped or quiet, one
light line in a notebook. The terminal is a real pseudo-terminal (pty) around a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from multihead import _progress
from multihead._progress import progress, quiet, track

FILE = os.path.abspath(_progress.__file__)
# the module alone (it imports only the standard library): a child that starts in a blink
SCRIPT = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("_progress", {FILE!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
progress, track = m.progress, m.track
with progress("building the page", total=3) as bar:
    for _ in range(3):
        time.sleep(0.12)
        bar.update(note="layer")
for _ in track(range(2), "second task"):
    pass
print("result on stdout")
"""


def run_child(stderr_to_pty: bool, env_extra=None) -> tuple[str, str]:
    """(stdout, stderr) of SCRIPT in a child whose stderr is a pty or a pipe."""
    env = {k: v for k, v in os.environ.items() if k != "MULTIHEAD_PROGRESS"} | (env_extra or {})
    if not stderr_to_pty:
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
        return done.stdout, done.stderr
    import pty

    master, slave = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=slave, env=env, text=True)
    os.close(slave)
    out, _ = child.communicate(timeout=120)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:   # the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return out, b"".join(chunks).decode()


@pytest.mark.skipif(sys.platform == "win32", reason="pty is POSIX")
def test_a_terminal_gets_a_bar_redrawn_in_place():
    out, err = run_child(True)
    assert out == "result on stdout\n"
    assert "\rbuilding the page [" in err                    # redrawn in place
    assert "] 3/3 " in err and "#" * 24 in err              # full at the end
    assert "building the page: done in" in err and "second task: done in" in err
    assert err.count("\n") == 2                              # one line per task, once finished


def test_a_pipe_gets_nothing():
    out, err = run_child(False)
    assert out == "result on stdout\n" and err == ""


@pytest.mark.skipif(sys.platform == "win32", reason="pty is POSIX")
def test_quiet_by_the_environment_even_in_a_terminal():
    out, err = run_child(True, {"MULTIHEAD_PROGRESS": "0"})
    assert out == "result on stdout\n" and err == ""


class OutStream:
    """What ipykernel puts in sys.stderr (matched by its type name): not a terminal."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return False


def test_a_notebook_gets_one_light_line(monkeypatch):
    monkeypatch.delenv("MULTIHEAD_PROGRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    stream = OutStream()
    monkeypatch.setattr(sys, "stderr", stream)
    with progress("loading SmolLM2", total=100) as bar:
        for _ in range(100):
            bar.update()
    assert stream.text.startswith("loading SmolLM2 ... done (") and stream.text.endswith(" s)\n")
    assert "\r" not in stream.text and stream.text.count("\n") == 1


def test_quiet_and_nesting_in_process(monkeypatch, capsys):
    monkeypatch.setenv("MULTIHEAD_PROGRESS", "1")   # a bar whatever stderr is
    with quiet():
        list(track(range(3), "hidden"))
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(_progress, "_REDRAW_S", 0.0)
    with progress("outer", total=1) as bar:
        with progress("inner", total=2) as inner:
            inner.update()
            inner.update()
        bar.update()
    err = capsys.readouterr().err
    assert "outer [" in err and "inner: 1/2" in err and "inner: 2/2" in err
    assert "\rinner" not in err and "inner: done" not in err   # one bar: the inner task is its note
    assert err.count("\n") == 1


def test_an_error_inside_stops_the_bar_with_a_line(monkeypatch, capsys):
    monkeypatch.setenv("MULTIHEAD_PROGRESS", "1")
    with pytest.raises(KeyError):
        with progress("loading", total=4):
            raise KeyError("x")
    assert "loading: stopped after" in capsys.readouterr().err
