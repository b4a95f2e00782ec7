# SPDX-License-Identifier: BSD-3-Clause
"""Which of this machine's addresses and interfaces reach MASTER_ADDR: for run.sh's multi-node start and the doctor.

torchrun picks the rendezvous host, the address it gives the other nodes and gloo's interface from this machine's
hostname: wrong where the hostname resolves to another interface (a management network, a loopback entry).
MASTER_ADDR says it better: the node that holds it hosts, and every node uses the address and interface that its
routing table picks to reach it (`ip -o route get MASTER_ADDR`). Standard library only (torch imports slowly).

    python tools/hosts.py plan    one line saying what this node uses; for run.sh: WAIT IS_HOST LOCAL_ADDR INTERFACE
    python tools/hosts.py wait    wait (up to RDZV_TIMEOUT) until MASTER_ADDR:MASTER_PORT answers, or one line why not
Both read MASTER_ADDR, MASTER_PORT, RDZV_TIMEOUT, TORCHRUN_ARGS and *_SOCKET_IFNAME: what the user set wins."""

import ipaddress
import os
import socket
import subprocess
import sys
import time


def resolve(name):
    """The addresses name resolves to here, IPv4 first (what torch's TCPStore tries first), without repeats."""
    infos = sorted(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM), key=lambda info: info[0] != socket.AF_INET)
    return list(dict.fromkeys(info[4][0] for info in infos))


def holds(address):
    """Whether this machine holds address: only then can a socket bind to it."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def route(address, held):
    """(local address, interface) reaching address: `ip -o route get` (held: `ip -o addr show to`); without iproute2
    (a slim container image) the address a UDP connect picks, the interface unknown. OSError with the reason."""
    args = ("addr", "show", "to", address) if held else ("route", "get", address)
    try:
        done = subprocess.run(["ip", "-o", *args], capture_output=True, text=True, timeout=10, check=True)
    except subprocess.CalledProcessError as error:  # e.g. "RTNETLINK answers: Network is unreachable"
        raise OSError(error.stderr.strip().rpartition(": ")[2] or "no route") from None
    except FileNotFoundError:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            return (address if held else sock.getsockname()[0]), None
    except (OSError, subprocess.TimeoutExpired) as error:
        raise OSError(f"`ip -o {' '.join(args)}` (iproute2) failed: {error}") from None
    words = done.stdout.split()  # "2: eth0    inet 10.0.0.1/24 ..." or "10.0.0.2 via 10.0.0.254 dev eth0 src 10.0.0.1"
    if held:
        return address, words[1] if len(words) > 1 else None
    return tuple(words[words.index(key) + 1] if key in words else None for key in ("src", "dev"))


def is_loopback(address):
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"


class Plan:
    """What this node uses to meet the others at MASTER_ADDR; raises OSError with a one-line reason."""

    def __init__(self, master_addr):
        self.master_addr = master_addr
        try:
            addresses = resolve(master_addr)
        except OSError as error:
            raise OSError(
                f"MASTER_ADDR {master_addr} does not resolve on this node ({error.strerror or error}): "
                f"give the first node's IP address, or a name that every node resolves"
            ) from None
        held = [address for address in addresses if holds(address)]
        self.is_host = bool(held)  # MASTER_ADDR is an address of this machine
        self.target = (held or addresses)[0]  # the address of MASTER_ADDR this node connects to
        try:
            self.local_addr, self.interface = route(self.target, self.is_host)
        except OSError as error:
            named = f" ({self.target})" if self.target != master_addr else ""
            raise OSError(
                f"no route from this node to MASTER_ADDR {master_addr}{named}: "
                f"{error}: check MASTER_ADDR, or this node's network"
            ) from None
        # A name resolving to loopback here ("127.0.1.1 node1") names this node: the others get the name
        self.loopback_name = is_loopback(self.local_addr) and not is_loopback(master_addr)
        if self.loopback_name:
            self.local_addr = master_addr
            self.interface = None

    def where(self):
        return f"{self.local_addr}" + (f" on {self.interface}" if self.interface else "")


def wait(host, port, timeout, where):
    """Connect to host:port every second until it answers (None) or timeout seconds passed (an error line)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(1.0, min(5.0, deadline - time.monotonic()))).close()
            return None
        except OSError as error:
            last = error
        if time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if isinstance(last, ConnectionRefusedError):
        why = (
            "connection refused: nothing listens on that port: start the same command on the node that holds "
            f"{host} (MASTER_ADDR), with the same MASTER_PORT on every node"
        )
    elif isinstance(last, TimeoutError):
        why = "no answer: no machine holds that address here, or a firewall drops the port: check MASTER_ADDR"
    else:  # e.g. no route to host: nobody answers for that address on this network
        why = f"{(last.strerror or str(last)).lower()}: check MASTER_ADDR and MASTER_PORT"
    return (
        f"cannot reach MASTER_ADDR:MASTER_PORT {host}:{port} from this node ({where}) within {timeout:g} s "
        f"(RDZV_TIMEOUT): {why}"
    )


def plan_line(plan, env):
    """run.sh's values, "WAIT IS_HOST LOCAL_ADDR INTERFACE" ("-": leave it to torchrun or to the user), and the one
    line that says what this node uses. What the user already set (TORCHRUN_ARGS, *_SOCKET_IFNAME) is kept."""
    import argparse
    import shlex

    parser = argparse.ArgumentParser(add_help=False)  # torchrun's two spellings of the options run.sh would set
    parser.add_argument("--local-addr", "--local_addr")
    parser.add_argument("--rdzv-conf", "--rdzv_conf", default="")
    given = parser.parse_known_args(shlex.split(env.get("TORCHRUN_ARGS", "")))[0]
    conf = dict(item.strip().partition("=")[::2] for item in given.rdzv_conf.split(","))
    is_host = conf["is_host"].strip().lower() in ("1", "true", "yes", "y") if "is_host" in conf else None
    chosen = [f"--local-addr={given.local_addr} (yours)" if given.local_addr else f"--local-addr={plan.local_addr}"]
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        chosen += (
            [f"{name}={env[name]} (yours)"] if env.get(name) else [f"{name}={plan.interface}"] * bool(plan.interface)
        )
    hosts = plan.is_host if is_host is None else is_host
    held = f"MASTER_ADDR {plan.master_addr}" + (f" ({plan.target})" if plan.target != plan.master_addr else "")
    line = (
        f"this node holds {held} and hosts the rendezvous"
        if hosts
        else f"this node joins the rendezvous at {plan.target}:{env.get('MASTER_PORT', '29500')} (MASTER_ADDR)"
    )
    line += f"; it uses {' '.join(chosen)}"
    if plan.loopback_name:
        line += (
            f" ({plan.master_addr} resolves to {plan.target}, a loopback address, on this node: set "
            f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface of the network the nodes share)"
        )
    # is_host left to torchrun for a loopback MASTER_ADDR: several agents on one machine, and torchrun's guess (host)
    # lets the agents after the first fall back to joining; given, it would not
    values = [
        "0" if hosts else "1",
        "-" if is_host is not None or is_loopback(plan.target) else str(int(plan.is_host)),
        "-" if given.local_addr else plan.local_addr,
        plan.interface or "-",
    ]
    return " ".join(values), f"run.sh: {line}"


def main(command, env):
    if command not in ("plan", "wait") or not env.get("MASTER_ADDR"):
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    try:
        plan = Plan(env["MASTER_ADDR"])
    except OSError as error:
        print(f"run.sh: {error}", file=sys.stderr)
        return 2
    if command == "plan":
        values, line = plan_line(plan, env)
        print(line, file=sys.stderr)
        print(values)
        return 0
    try:
        error = wait(
            plan.target, int(env.get("MASTER_PORT", "29500")), float(env.get("RDZV_TIMEOUT", "300")), plan.where()
        )
    except KeyboardInterrupt:
        return 130
    if error:
        print(f"run.sh: {error}", file=sys.stderr)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "", os.environ))
