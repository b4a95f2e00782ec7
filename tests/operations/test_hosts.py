"""Several machines, made real: two network namespaces joined by a veth pair are two hosts with network stacks of
their own (10.77.N.1 and 10.77.N.2, nothing else reachable), sharing the data and output folders as NFS would. In
both, the hostname (`vm` here, from the shared /etc/hosts) resolves to 127.0.0.1: the multi-homed case in which
torchrun, left to the hostname, never forms the job. One `bash run.sh ddp 1` agent runs in each.

Needs root and `ip netns` (skipped otherwise). The namespaces have names of their own and are removed whatever
happens; every process is bounded in time.
"""

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from support import DEFAULTS, assert_same_weights, finish, job_env, load_model_state, run, run_together, start


def ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def veth_pair(prefix, subnet):
    """Two network namespaces joined by a veth pair, removed afterwards: {"a": (namespace, address, interface),
    "b": ...}, addresses 10.{subnet}.X.1 and .2. Skips the test where they cannot be made."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("needs root, ip (iproute2) and unshare to make network namespaces")
    tag, net = f"{os.getpid() % 100000:05d}", f"10.{subnet}.{os.getpid() % 250}"
    made = {x: (f"{prefix}h{tag}{x}", f"{net}.{n}", f"{prefix}v{tag}{x}") for n, x in enumerate("ab", 1)}
    (ns_a, _, if_a), (ns_b, _, if_b) = made["a"], made["b"]
    steps = [
        ["netns", "add", ns_a],
        ["netns", "add", ns_b],
        ["link", "add", if_a, "type", "veth", "peer", "name", if_b],
    ]
    for ns, address, interface in made.values():
        steps += [
            ["link", "set", interface, "netns", ns],
            ["-n", ns, "addr", "add", f"{address}/24", "dev", interface],
            ["-n", ns, "link", "set", interface, "up"],
            ["-n", ns, "link", "set", "lo", "up"],
        ]
    try:
        for step in steps:
            result = ip(*step)
            if result.returncode:
                pytest.skip(f"cannot make network namespaces here: ip {' '.join(step)}: {result.stderr.strip()}")
        yield made
    finally:
        for ns, _, interface in made.values():
            ip("netns", "del", ns)  # removes its end of the veth pair, and with it the pair
            ip("link", "del", interface)  # in case it never left this namespace


@pytest.fixture(scope="module")
def hosts():
    """{"a": (namespace, address, interface), "b": ...}: two hosts joined by a veth pair."""
    with veth_pair("rs", 77) as made:
        yield made


def in_host(host, command, hostname=None, hosts_file=None):
    """command run inside the host's namespace; with a hostname and a hosts file of its own if given (as on a
    cluster whose hostnames resolve to their cluster addresses)."""
    prefix = ["ip", "netns", "exec", host[0]]
    if hostname is None:
        return prefix + command
    return prefix + [
        "unshare",
        *"--uts --mount sh -c".split(),
        'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"',
        "sh",
        str(hosts_file),
        hostname,
        *command,
    ]


# The network is under test here, not the loader: data loading in the main process (the sample stream is the same
# with or without loader workers); a collective that waits for the other host longer than 60 s ends the job with a
# traceback naming it, well within the test's own bound
BOUNDED = ["--workers", "0", "--dist-timeout", "60"]


def nodes_env(master_addr, **extra):
    """Two nodes; RDZV_TIMEOUT bounds every wait for the other node (they meet within seconds when they can)."""
    return {
        **job_env(),
        "NNODES": "2",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": "29500",
        "RDZV_TIMEOUT": "120",
        "RDZV_ID": f"hosts-{os.getpid()}-{time.time_ns()}",
        **extra,
    }


def test_two_hosts_train_with_master_addr_an_address_and_match_one_node(hosts, default_ddp, tiny_data, tmp_path):
    """The README's command on each host, MASTER_ADDR the first host's address. Without what run.sh derives, neither
    agent hosts the store (the hostname resolves to 127.0.0.1) and both fail after minutes."""
    (_, address_a, if_a), (_, address_b, if_b) = hosts["a"], hosts["b"]
    command = [
        "bash",
        "run.sh",
        "ddp",
        "1",
        *DEFAULTS,
        *BOUNDED,
        "--data-path",
        str(tiny_data),
        "--output-dir",
        str(tmp_path / "run"),
    ]
    results = run_together(
        [in_host(hosts["a"], command), in_host(hosts["b"], command)], env=nodes_env(address_a), timeout=300
    )
    assert [node.returncode for node in results] == [0, 0], results
    (out_a, err_a), (out_b, err_b) = ((node.stdout, node.stderr) for node in results)
    assert (
        f"run.sh: this node holds MASTER_ADDR {address_a} and hosts the rendezvous; it uses "
        f"--local-addr={address_a} GLOO_SOCKET_IFNAME={if_a} NCCL_SOCKET_IFNAME={if_a}"
    ) in err_a.splitlines()
    assert (
        f"run.sh: this node joins the rendezvous at {address_a}:29500 (MASTER_ADDR); it uses "
        f"--local-addr={address_b} GLOO_SOCKET_IFNAME={if_b} NCCL_SOCKET_IFNAME={if_b}"
    ) in err_b.splitlines()
    assert (out_a + out_b).count("global batch 16 = 8 per process x 2 processes") == 1
    # 2 hosts x 1 process equal 1 machine x 2 processes (with loader workers), one thread each: bitwise, BatchNorm
    # training included
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(default_ddp / "last.pt"))


def test_two_hosts_whose_hostnames_resolve_to_their_cluster_addresses_train(hosts, default_ddp, tiny_data, tmp_path):
    """SLURM's way (MASTER_ADDR=$(scontrol show hostnames ... | head -n 1)): each host has its own hostname, which
    resolves to its cluster address, and MASTER_ADDR is the first one's name. torchrun's own guesses are right here,
    and run.sh's (is_host from MASTER_ADDR) agree with them."""
    (_, address_a, if_a), (_, address_b, _) = hosts["a"], hosts["b"]
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"127.0.0.1 localhost\n{address_a} rsnode-a\n{address_b} rsnode-b\n")
    command = [
        "bash",
        "run.sh",
        "ddp",
        "1",
        *DEFAULTS,
        *BOUNDED,
        "--data-path",
        str(tiny_data),
        "--output-dir",
        str(tmp_path / "run"),
    ]
    results = run_together(
        [in_host(hosts["a"], command, "rsnode-a", hosts_file), in_host(hosts["b"], command, "rsnode-b", hosts_file)],
        env=nodes_env("rsnode-a"),
        timeout=300,
    )
    assert [node.returncode for node in results] == [0, 0], results
    assert (
        f"run.sh: this node holds MASTER_ADDR rsnode-a ({address_a}) and hosts the rendezvous; it uses "
        f"--local-addr={address_a} GLOO_SOCKET_IFNAME={if_a} NCCL_SOCKET_IFNAME={if_a}"
    ) in results[0].stderr
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(default_ddp / "last.pt"))


def test_nodes_that_cannot_meet_end_within_rdzv_timeout_with_one_line(hosts, tmp_path):
    """A wrong MASTER_ADDR (an address nobody holds, on both hosts), and a right one whose host never started (a
    closed port): each ends within RDZV_TIMEOUT with one line naming what it could not reach from where."""
    (_, address_a, if_a), (_, address_b, if_b) = hosts["a"], hosts["b"]
    wrong = address_a.rsplit(".", 1)[0] + ".99"
    command = ["bash", "run.sh", "ddp", "1", "--epochs", "1", "--output-dir", str(tmp_path / "run")]
    timeout = 10
    wrong_results = run_together(
        [in_host(hosts["a"], command), in_host(hosts["b"], command)],
        env=nodes_env(wrong, RDZV_TIMEOUT=str(timeout)),
        timeout=120,
    )
    closed = run_together(
        [in_host(hosts["b"], command)], env=nodes_env(address_a, RDZV_TIMEOUT=str(timeout)), timeout=120
    )
    for node, (address, interface), target, why in [
        (wrong_results[0], (address_a, if_a), wrong, r"(no route to host|no answer)"),
        (wrong_results[1], (address_b, if_b), wrong, r"(no route to host|no answer)"),
        (closed[0], (address_b, if_b), address_a, r"connection refused: nothing listens on that port"),
    ]:
        code, out, err, seconds = node.returncode, node.stdout, node.stderr, node.seconds
        lines = err.splitlines()
        assert code == 1 and len(lines) == 2, (code, err)
        assert lines[0].startswith(f"run.sh: this node joins the rendezvous at {target}:29500"), lines
        assert re.fullmatch(
            rf"run\.sh: cannot reach MASTER_ADDR:MASTER_PORT {re.escape(target)}:29500 from this node "
            rf"\({re.escape(address)} on {interface}\) within {timeout} s \(RDZV_TIMEOUT\): {why}.*",
            lines[1],
        ), lines[1]
        assert seconds < timeout + 40, seconds  # torch's import and the GPU query come first; no minutes of retries
        assert out == ""
        print(f"{target} from {address}: ended after {seconds:.1f} s (RDZV_TIMEOUT {timeout})")


def test_doctor_says_which_address_and_interface_this_node_uses_and_what_the_hostname_breaks(hosts, tmp_path):
    (_, address_a, _), (_, address_b, if_b) = hosts["a"], hosts["b"]
    env = job_env(MASTER_ADDR=address_a, MASTER_PORT="29500")
    listener = start(
        in_host(
            hosts["a"],
            [
                sys.executable,
                "-c",
                (
                    "import socket, time; s = socket.socket(); "
                    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                    "s.bind(('0.0.0.0', 29500)); s.listen(); print('up', flush=True); time.sleep(60)"
                ),
            ],
        ),
        timeout=90,
    )
    try:
        assert listener.stdout.readline() == "up\n"
        answered = run(in_host(hosts["b"], ["bash", "run.sh", "doctor", "--no-allreduce"]), env=env, timeout=120)
    finally:
        listener.kill()
        finish(listener, [], timeout=30)
    closed = run(in_host(hosts["b"], ["bash", "run.sh", "doctor", "--no-allreduce"]), env=env, timeout=120)
    for result, port in ((answered, "something is listening there"), (closed, "nothing listens there yet")):
        lines = result.stdout.splitlines()
        assert result.returncode == 0, result.stdout + result.stderr
        network = [line for line in lines if " MASTER_ADDR " in line and "another machine" in line]
        assert network == [
            f"ok    MASTER_ADDR {address_a} is another machine; this node reaches it from {address_b} "
            f"on {if_b} (run.sh: --local-addr={address_b} GLOO_SOCKET_IFNAME={if_b} "
            f"NCCL_SOCKET_IFNAME={if_b})"
        ], lines
        # the namespaces share this machine's hostname and /etc/hosts: it resolves to loopback (as `vm` does here) or
        # to an address of the machine outside the namespaces, never to the address the other host can reach
        hostname = [line for line in lines if "hostname" in line]
        assert len(hostname) == 1, lines
        assert hostname[0].startswith(f"warn  hostname {socket.gethostname()} resolves to "), hostname
        assert "other machines cannot connect" in hostname[0] and "GLOO_SOCKET_IFNAME" in hostname[0], hostname
        assert any(line.startswith("ok    MASTER_ADDR=") and port in line for line in lines), lines


def test_without_iproute2_a_node_still_finds_the_address_that_reaches_master_addr(hosts):
    """Slim container images have no `ip`: the plan falls back to the address a UDP connect picks, interface unknown."""
    (_, address_a, _), (_, address_b, _) = hosts["a"], hosts["b"]
    env = job_env(MASTER_ADDR=address_a, MASTER_PORT="29500", PATH="/nonexistent")
    command = in_host(hosts["b"], [sys.executable, "tools/hosts.py", "plan"])
    plan = run([shutil.which("ip"), *command[1:]], env=env, timeout=60)  # `ip netns exec` itself, by its full path
    assert plan.returncode == 0 and plan.stdout.split() == ["1", "0", address_b, "-"], plan.stdout + plan.stderr
