"""Regression (issue 11 item 3): a call that releases the GIL converts its error with the GIL held.

A Worker that failed to start used to set the Python error without the GIL and kill the
interpreter (SIGSEGV). Each case runs in a child interpreter so that, on a broken module, the test
fails with the child's exit status instead of killing pytest.
"""
import os
import socket
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))


def run_child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_busy_port_raises_and_the_interpreter_lives_on():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        child = run_child(f"""
            import kvferry
            try:
                kvferry.Worker("kv_producer", "busy", base_port={port})
            except kvferry.Error as e:
                print(type(e).__name__, e)
            print("alive")
        """)
    assert child.returncode == 0, f"child died with {child.returncode}: {child.stderr}"
    assert "alive" in child.stdout
    first = child.stdout.splitlines()[0]
    assert first.startswith("UnavailableError"), child.stdout
    assert str(port) in first


def test_invalid_tp_rank_raises_and_the_interpreter_lives_on():
    child = run_child("""
        import kvferry
        try:
            kvferry.Worker("kv_producer", "bad-rank", tp_size=2, tp_rank=5, base_port=1)
        except kvferry.InvalidArgumentError as e:
            print("InvalidArgumentError", e)
        print("alive")
    """)
    assert child.returncode == 0, f"child died with {child.returncode}: {child.stderr}"
    assert child.stdout.splitlines() == [child.stdout.splitlines()[0], "alive"]
    assert child.stdout.startswith("InvalidArgumentError TP rank 5")
