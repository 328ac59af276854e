"""The suite's ``capsys`` drops the lines Ray forwards from other processes, never ours."""

import sys


def test_ray_forwarded_lines_leave_capsys_err_and_ours_stay(capsys):
    print(
        "\x1b[33m(raylet)\x1b[0m [2026-12-02 19:35:30,258 E 30461 30476] (raylet) file_system_monitor.cc:116: /tmp/ray/session is over 95% full",
        file=sys.stderr,
    )
    print("\x1b[36m(MapWorker(MapBatches(fn)) pid=123, ip=127.0.0.1)\x1b[0m hello", file=sys.stderr)
    print("(autoscaler +3s) Tip", file=sys.stderr)
    print("(pid=55) x", file=sys.stderr)
    print("error: s3://bucket/ex did not answer (pid=3) sorry", file=sys.stderr)
    print("out")
    r = capsys.readouterr()
    assert r.err == "error: s3://bucket/ex did not answer (pid=3) sorry\n", r.err
    assert r.out == "out\n"
