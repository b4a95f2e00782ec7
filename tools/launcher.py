# SPDX-License-Identifier: BSD-3-Clause
"""run.sh's two helpers around the launcher (torchrun, torch.distributed.launch), for what its own options cannot do
(--log-dir, --redirects, --tee and --local-ranks-filter sort the ranks' output; none ties the launcher to run.sh or
drops its own report):

    python tools/launcher.py tie PARENT_PID COMMAND...
        exec COMMAND with Linux's parent-death signal set to SIGTERM: if run.sh dies (kill -9, a job manager or CI
        timeout), the launcher stops the job as on SIGTERM instead of training on as an orphan.

    python tools/launcher.py filter OUT_FIFO ERR_FIFO LOG
        pass the job's output on, leaving out the launcher's own report where the job already said what happened:
        its traceback for a signal (the ranks printed `stopped by ...`), its failure report (an `E...` log line, a
        ChildFailedError traceback and its "Root Cause" box) once a rank printed its one `error:` line or its
        `stopped by ...` line (a signal that reached the ranks alone), a rendezvous failure's frames, for which it
        prints one line, and the report of a rank killed by a signal (the out-of-memory killer's SIGKILL), for
        which it prints one line naming the rank. Any other traceback is shown whole. LOG gets the whole stderr,
        kept (and named in one line) only when something not a signal report was left out: moved into the run
        folder (launcher.log) once rank 0 has named it ("output in DIR"), else left where it is. Exits with the
        number of the signal that stopped the agent, or the ranks (0 if none). Failed writes (a closed terminal, a
        broken pipe) are dropped and it reads on, so that the ranks can still save and end.
"""

import os
import re
import selectors
import shutil
import signal
import sys

TRACEBACK = "Traceback (most recent call last):"
CHAIN = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
LAUNCHER_LOG = re.compile(r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/\S+:\d+\] ")  # Python logging
CPP_LOG = re.compile(r"\[[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ \S+\] ")  # c10d's C++ log lines, and what follows them:
CPP_MORE = re.compile(r"(Exception raised from |frame #\d+: |<omitting python frames>)")
SIGNAL = re.compile(r"torch\S*SignalException: Process \d+ got signal: (\d+)$")
RENDEZVOUS = re.compile(r"torch\S*\.(Rendezvous\w*Error)\b")
CHILD_FAILED = re.compile(r"torch\S*\.ChildFailedError:")
RUN_FOLDER = re.compile(r"; output in (.+)$")  # rank 0's header line
STOPPED = re.compile(r"stopped by (SIG[A-Z0-9]+) after step ")  # the ranks' line after a stop (utils.StopOnSignal)
# ChildFailedError's box: the first failure's rank, and its exit code (negative: the signal that ended it) and pid
ROOT_CAUSE = re.compile(r"Root Cause.*?\n\s+rank\s+: (\d+).*?\n\s+exitcode\s+: (-?\d+) \(pid: (\d+)\)", re.S)


def tie(parent, command):
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGTERM) == 0 and os.getppid() != parent:  # 1: PR_SET_PDEATHSIG
            sys.exit(f"run.sh: run.sh ended before {command[0]} started")  # it died before prctl took effect
    os.execvp(command[0], command)


class Output:
    """A stream that may go away (a terminal closed by SIGHUP, a reader gone): then writes are dropped."""

    def __init__(self, fd):
        self.fd = fd
        self.alive = True

    def write(self, text):
        if self.alive and text:
            try:
                os.write(self.fd, text.encode(errors="replace"))
            except OSError:
                self.alive = False


class Filter:
    """The stderr lines, in groups: lines that look like the launcher's (its log lines, c10d's C++ log lines and
    frames, tracebacks and the lines that chain them) are held until a line of the job's own arrives, or the
    streams end, and are then shown or left out as a whole."""

    def __init__(self, err, log):
        self.err = err
        self.log = log
        self.held = []  # the group's lines
        self.state = None  # inside a group: "traceback", "exception" (its last line seen) or "box"
        self.chains = []  # the group's tracebacks, chained ones together: their exceptions' lines
        self.explained = False  # a rank printed its one `error:` line
        self.left_out = None  # why the log is worth keeping: "explained" or "rendezvous"
        self.signal = 0  # the signal that stopped the agent, from its report
        self.rendezvous = None  # a rendezvous failure's error type
        self.detail = ""  # what caused it
        self.rules = 0  # the lines of "=" seen of ChildFailedError's box
        self.run_folder = None  # where the job writes, once rank 0's header said it
        self.stopped = 0  # the signal the ranks stopped on, from their `stopped by` line
        self.killed = None  # (rank, pid, signal name) of a rank that a signal ended

    def line(self, line):
        self.log.write(line)
        self.log.flush()
        if not self.take(line):  # a line of the job's own: the group before it is complete
            self.flush()
            self.explained |= line.startswith("error: ")
            self.err.write(line)

    def take(self, line):
        """Add line to the held group if it belongs there."""
        text = line.rstrip("\n")
        if self.state == "traceback":
            if text[:1] in " \t" or not text:  # a frame (a blank line: a signal interrupted the agent there)
                self.held.append(line)
                return True
            self.chains[-1].append(text)  # the exception's line ends the traceback
            self.state = "box" if text.rstrip().endswith("ChildFailedError:") else "exception"
            self.rules = 0
        elif self.state == "box":  # ChildFailedError's message: a box between two lines of "="
            self.rules += text.startswith("=====")
            self.state = "exception" if self.rules == 2 else "box"
        elif text == TRACEBACK:
            chained = any(held.strip() in CHAIN for held in self.held[-2:])
            if not chained:
                self.chains.append([])
            self.state = "traceback"
        elif not (
            LAUNCHER_LOG.match(text)
            or CPP_LOG.match(text)
            or CPP_MORE.match(text)
            or text in CHAIN
            or (not text and self.held)
        ):
            return False
        self.held.append(line)
        return True

    def flush(self):
        """Show or leave out the held group, as a whole."""
        held = self.held
        chains = self.chains
        self.held = []
        self.chains = []
        self.state = None
        finals = [chain[-1] for chain in chains if chain]
        if any(not (SIGNAL.match(final) or RENDEZVOUS.match(final) or CHILD_FAILED.match(final)) for final in finals):
            self.err.write("".join(held))  # a crash: shown whole
            return
        stopped = False
        for chain in filter(None, chains):
            if rendezvous := RENDEZVOUS.match(chain[-1]):
                self.rendezvous = rendezvous.group(1)
                self.detail = chain[0].partition(": ")[2] if chain[1:] else ""  # its cause, if any, says what failed
            elif agent_signal := SIGNAL.match(chain[-1]):
                self.signal = int(agent_signal.group(1))
                stopped = True
        box = ROOT_CAUSE.search("".join(held))
        if self.rendezvous:
            self.left_out = "rendezvous"
        elif stopped or self.stopped:
            pass  # the report of the signal that stopped the agent, or the ranks: they said so already
        elif self.explained:
            self.left_out = self.left_out or "explained"
        elif box and int(box[2]) < 0:  # a rank that a signal ended said nothing: this line says it
            self.killed = (box[1], box[3], signal.Signals(-int(box[2])).name)
            self.left_out = "killed"
        else:
            self.err.write("".join(held))


def close_report(flt, log_path):
    """The lines that stand for what was left out. LOG is removed when it holds nothing that was not shown."""
    if flt.left_out is None:
        os.unlink(log_path)
        return
    if flt.left_out == "killed":
        rank, pid, name = flt.killed
        why = ", most likely by the out-of-memory killer (dmesg says which)" if name == "SIGKILL" else ""
        again = f" --output-dir {flt.run_folder}" if flt.run_folder else ""
        flt.err.write(
            f"run.sh: rank {rank} (pid {pid}) was killed by {name}{why}: lower --batch-size or --workers, then "
            f"continue with --resume auto{again}\n"
        )
    if flt.left_out == "rendezvous":
        env = os.environ.get
        where = f"{env('MASTER_ADDR')}:{env('MASTER_PORT')}"
        if flt.rendezvous == "RendezvousTimeoutError":
            flt.err.write(
                f"run.sh: not all {env('NNODES')} nodes joined {where} within {env('RDZV_TIMEOUT')}s "
                f"(RDZV_TIMEOUT): start the same command on every node, and check that they reach that "
                f"address\n"
            )
        else:
            flt.err.write(
                f"run.sh: the nodes could not meet at {where} ({flt.rendezvous}"
                f"{': ' + flt.detail if flt.detail else ''}): check MASTER_ADDR and MASTER_PORT on every "
                f"node (bash run.sh doctor)\n"
            )
    if flt.run_folder and os.path.isdir(flt.run_folder):  # where the user looks: not a temporary folder that fills up
        kept = os.path.join(flt.run_folder, "launcher.log")
        try:
            shutil.move(log_path, kept)
            log_path = kept
        except OSError:  # (a full or read-only disk: it stays where it was)
            pass
    flt.err.write(f"run.sh: the launcher's full report: {log_path}\n")


def filter_streams(out_fifo, err_fifo, log_path):
    # Open in the order the launcher's redirections open them (each open waits for its writer), then remove the
    # names, so that nothing is left behind even if run.sh is killed.
    out_fd = os.open(out_fifo, os.O_RDONLY)
    err_fd = os.open(err_fifo, os.O_RDONLY)
    for path in (out_fifo, err_fifo):
        os.unlink(path)
    out = Output(1)
    with open(log_path, "w") as log:
        flt = Filter(Output(2), log)
        partial = {out_fd: b"", err_fd: b""}
        selector = selectors.DefaultSelector()
        for fd in partial:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                chunk = os.read(key.fd, 1 << 16)
                data = partial[key.fd] + chunk
                if chunk:
                    *lines, partial[key.fd] = data.split(b"\n")
                    lines = [line + b"\n" for line in lines]
                else:  # end of stream: a last line without its newline
                    lines = [data] if data else []
                    partial[key.fd] = b""
                    selector.unregister(key.fd)
                    os.close(key.fd)
                for line in lines:
                    text = line.decode(errors="replace")
                    if key.fd == err_fd:
                        flt.line(text)
                        continue
                    if flt.state in (None, "exception"):
                        flt.flush()  # the job is talking: a group of the launcher's lines is complete
                    if flt.run_folder is None and (named := RUN_FOLDER.search(text.rstrip("\n"))):
                        flt.run_folder = named[1]
                    if stopped := STOPPED.match(text):
                        flt.stopped = signal.Signals[stopped[1]]
                    out.write(text)
        flt.flush()
    close_report(flt, log_path)
    return flt.signal or flt.stopped


def main(argv):
    if len(argv) > 3 and argv[1] == "tie":
        tie(int(argv[2]), argv[3:])
    if len(argv) == 5 and argv[1] == "filter":
        return filter_streams(*argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
