# The program that stands in for ``sys.executable`` in the processes the test zygotes fork (tests/zygote.py,
# ``Launcher.forks`` writes it with its interpreter's line above this text). Started as
# ``python [-u] script|-m module|-c code args...``, it asks the launcher for a fork of a zygote that becomes that
# process: the same arguments, environment, working folder, stdin, stdout and stderr (the child opens this
# process's own through /proc), its namespaces (on a host of tools/hosts.py: the host's network, name, mounts and
# process ids), and a new session as torchrun's workers have. It waits for the fork's exit code and ends with it
# (a signal's death as that signal), and passes on (through the launcher) the signals a launcher sends to stop its
# processes. Anything a fork would not reproduce runs the real interpreter instead, unchanged: an interpreter
# option, a file descriptor beyond 0-2 handed down (multiprocessing's and inductor's workers), a stdio that is a
# socket, a launcher that cannot be reached, or (decided by the launcher) an environment the zygotes did not import
# in or namespaces other than a host's.
import json
import os
import signal
import socket
import stat
import sys

FORKS_VAR = "DISTTRAIN_TEST_FORKS"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def fresh() -> None:
    with open(__file__) as this:  # its first line, "#!INTERPRETER -SE": the real one
        real = this.readline()[2:].split()[0]
    os.execv(real, [real, *sys.argv[1:]])


def to_fork(args: list[str]) -> list[str] | None:
    """The arguments a fork runs (``-u`` dropped: the zygotes' children write through already), or None where a
    fork would not be this process."""
    if args[:1] == ["-u"]:
        args = args[1:]
    if not args:
        return None  # an interactive interpreter
    if args[0] in ("-m", "-c"):
        if len(args) < 2:
            return None
    elif args[0].startswith("-"):
        return None  # another option of the interpreter
    for fd in range(3):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            return None
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            return None
    listed = [int(fd) for fd in os.listdir("/proc/self/fd")]  # the listing's own descriptor is closed again now
    for fd in listed:
        if fd > 2:
            try:
                os.fstat(fd)
                return None  # handed down: a fork would not have it
            except OSError:
                pass
    return args


def main() -> None:
    forks = json.loads(os.environ.get(FORKS_VAR) or "null")
    args = to_fork(sys.argv[1:]) if forks else None
    if args is None:
        fresh()
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(forks["socket"])
    except OSError:
        fresh()
    conn.sendall((json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd(),
                              "after": forks.get("after", [])}) + "\n").encode())
    replies = conn.makefile("rb")
    first = json.loads(replies.readline() or b'{"fresh": "no answer"}')
    if "fresh" in first:
        conn.close()
        fresh()

    def forward(sig, _frame) -> None:  # the launcher sends it to the child's session: its children get it too
        try:
            conn.sendall((json.dumps({"signal": sig}) + "\n").encode())
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    line = replies.readline()
    code = json.loads(line)["exit"] if line else 1
    if code < 0:  # ended by a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


main()
