"""Which of this machine's addresses and interfaces reach MASTER_ADDR: for run.sh's multi-node start and the doctor.

torchrun decides whether it hosts the rendezvous store, which address it gives the other nodes, and gloo which
interface it binds, all from this machine's hostname; where the hostname resolves to another interface (a
management network, a container's or a cloud VM's loopback entry) the nodes never meet. MASTER_ADDR, which every
node is given, says it better: the node that holds it hosts, and every node uses the address (and its interface)
that its routing table picks to reach it.

    python tools/hosts.py plan    one line saying what this node uses; for run.sh: WAIT IS_HOST LOCAL_ADDR INTERFACE
    python tools/hosts.py wait    wait (up to RDZV_TIMEOUT) until MASTER_ADDR:MASTER_PORT answers, or one line why not

Both read MASTER_ADDR, MASTER_PORT, RDZV_TIMEOUT, TORCHRUN_ARGS and the *_SOCKET_IFNAME variables from the
environment: what the user set there wins. Standard library only: run.sh calls it before each multi-node start,
and torch would take seconds to import.
"""
import ctypes
import ctypes.util
import errno
import ipaddress
import os
import socket
import sys
import time


def resolve(name):
    """The addresses name resolves to here, IPv4 first (what torch's TCPStore tries first), without repeats."""
    infos = sorted(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM), key=lambda info: info[0] != socket.AF_INET)
    return list(dict.fromkeys(info[4][0] for info in infos))


def holds(address):
    """Whether this machine holds address: only then can a socket bind to it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def source_address(address):
    """The local address this machine's routing table picks to reach address (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))
        return sock.getsockname()[0]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.c_void_p), ("netmask", ctypes.c_void_p), ("broadaddr", ctypes.c_void_p),
                     ("data", ctypes.c_void_p)]


def interfaces():
    """{address: interface name} for every address of this machine (libc's getifaddrs, as `ip addr` lists them);
    {} where that is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return {}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        head = ctypes.POINTER(_Ifaddrs)()
        if libc.getifaddrs(ctypes.byref(head)) != 0:
            return {}
    except (OSError, AttributeError):
        return {}
    found = {}
    try:
        entry = head
        while entry:
            item = entry.contents
            family = ctypes.c_ushort.from_address(item.addr).value if item.addr else None  # Linux: family first
            if family == socket.AF_INET:  # sockaddr_in: family, port, then the 4-byte address
                address = socket.inet_ntop(socket.AF_INET, ctypes.string_at(item.addr + 4, 4))
                found.setdefault(address, item.name.decode())
            elif family == socket.AF_INET6:  # sockaddr_in6: family, port, flow info, then the 16-byte address
                address = socket.inet_ntop(socket.AF_INET6, ctypes.string_at(item.addr + 8, 16))
                found.setdefault(address, item.name.decode())
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def is_loopback(address):
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"


def torch_guesses_host(host):
    """torchrun's own guess (torch 2.x, c10d_rendezvous_backend._create_tcp_store without is_host): whether host
    names this machine, by its hostname and what that resolves to. Kept so that run.sh overrides it only where it
    is wrong."""
    if host == "localhost" or is_loopback(host):
        return True
    this = socket.gethostname()
    if host == this:
        return True
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        mine = socket.getaddrinfo(this, None, proto=socket.IPPROTO_TCP, flags=socket.AI_CANONNAME)
    except (OSError, ValueError):
        return False
    return any(info[3] == host or info[4][0] == host or info[4][0] in wanted for info in mine)


class Plan:
    """What this node uses to meet the others at MASTER_ADDR; raises OSError with a one-line reason."""

    def __init__(self, master_addr):
        self.master_addr = master_addr
        try:
            self.addresses = resolve(master_addr)
        except OSError as error:
            raise OSError(f"MASTER_ADDR {master_addr} does not resolve on this node ({error.strerror or error}): "
                          f"give the first node's IP address, or a name that every node resolves") from None
        held = [address for address in self.addresses if holds(address)]
        self.is_host = bool(held)
        self.target = held[0] if held else self.addresses[0]
        self.torch_guess = torch_guesses_host(master_addr)
        if self.is_host:
            self.local_addr = self.target
        else:
            try:
                self.local_addr = source_address(self.target)
            except OSError as error:
                named = f" ({self.target})" if self.target != master_addr else ""
                raise OSError(f"no route from this node to MASTER_ADDR {master_addr}{named}: "
                              f"{error.strerror or error}: check MASTER_ADDR, or this node's network") from None
        self.interface = interfaces().get(self.local_addr.split("%")[0])  # (an IPv6 link-local scope)
        # A name that resolves to loopback here (a hosts file's "127.0.1.1 node1") names this node, but the others
        # cannot reach that address: give them the name, and leave the interface to the user.
        self.loopback_name = is_loopback(self.local_addr) and not (master_addr == "localhost"
                                                                   or is_loopback(master_addr))
        if self.loopback_name:
            self.local_addr, self.interface = master_addr, None

    def where(self):
        return f"{self.local_addr}" + (f" on {self.interface}" if self.interface else "")


def wait(host, port, timeout, where):
    """Connect to host:port every second until it answers (True) or timeout seconds passed (an error line)."""
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
        why = ("connection refused: nothing listens on that port: start the same command on the node that holds "
               f"{host} (MASTER_ADDR), with the same MASTER_PORT on every node")
    elif isinstance(last, (socket.timeout, TimeoutError)):
        why = "no answer: no machine holds that address here, or a firewall drops the port: check MASTER_ADDR"
    elif last.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        why = f"{last.strerror.lower()}: no machine answers for that address on this network: check MASTER_ADDR"
    else:
        why = f"{last.strerror or last}: check MASTER_ADDR and MASTER_PORT"
    return f"cannot reach MASTER_ADDR:MASTER_PORT {host}:{port} from this node ({where}) within {timeout:g} s " \
           f"(RDZV_TIMEOUT): {why}"


def user_choices(torchrun_args):
    """What the user already chose in TORCHRUN_ARGS: (--local-addr's value or None, is_host's value or None)."""
    args = torchrun_args.split()
    local_addr = is_host = None
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--local-addr", "--local_addr"):
            local_addr = value or (args[i + 1] if i + 1 < len(args) else None)
        if name in ("--rdzv-conf", "--rdzv_conf"):
            conf = value or (args[i + 1] if i + 1 < len(args) else "")
            for item in conf.split(","):
                key, _, setting = item.partition("=")
                if key.strip() == "is_host":
                    is_host = setting.strip().lower() in ("1", "true", "yes", "y")
    return local_addr, is_host


def plan_line(plan, env):
    """run.sh's values, "WAIT IS_HOST LOCAL_ADDR INTERFACE" ("-": leave it to torchrun or to the user), and the one
    line that says what this node uses."""
    port = env.get("MASTER_PORT", "29500")
    local_addr, is_host = user_choices(env.get("TORCHRUN_ARGS", ""))
    chosen = []
    if local_addr:
        chosen.append(f"--local-addr={local_addr} (yours)")
    else:
        chosen.append(f"--local-addr={plan.local_addr}")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if env.get(name):
            chosen.append(f"{name}={env[name]} (yours)")
        elif plan.interface:
            chosen.append(f"{name}={plan.interface}")
    hosts = plan.is_host if is_host is None else is_host
    held = f"MASTER_ADDR {plan.master_addr}" + (f" ({plan.target})" if plan.target != plan.master_addr else "")
    if hosts:
        line = f"this node holds {held} and hosts the rendezvous"
    else:
        line = f"this node joins the rendezvous at {plan.target}:{port} (MASTER_ADDR)"
    line += f"; it uses {' '.join(chosen)}"
    if plan.loopback_name:
        line += (f" ({plan.master_addr} resolves to {plan.target}, a loopback address, on this node: set "
                 f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface of the network the nodes share)")
    values = [
        "0" if hosts else "1",
        "-" if is_host is not None or plan.is_host == plan.torch_guess else str(int(plan.is_host)),
        "-" if local_addr else plan.local_addr,
        plan.interface or "-",
    ]
    return " ".join(values), f"run.sh: {line}"


def main(argv):
    command = argv[1] if len(argv) > 1 else ""
    env = os.environ
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
        error = wait(plan.target, int(env.get("MASTER_PORT", "29500")), float(env.get("RDZV_TIMEOUT", "300")),
                     plan.where())
    except KeyboardInterrupt:
        return 130
    if error:
        print(f"run.sh: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
