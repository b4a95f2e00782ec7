"""The engines clusters run, without a cluster: each "pod" or "node" is a network namespace (as in test_hosts.py),
with a hostname and a hosts file of its own as Kubernetes and SLURM give them, and with exactly the variables its
engine sets, started the engine's way. What each engine sets was read from its source and is written out below
(docs/running.md#engines). Also: a 64 MB /dev/shm, a master that never answers, and the manifests in examples/.

Needs root, `ip netns` and `unshare` (skipped otherwise). Every process is bounded in time.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support import (
    DEFAULTS,
    REPO,
    assert_resumed_after,
    assert_same_weights,
    copy_rung,
    job_env,
    load_model_state,
    ranks,
    run,
    run_together,
    start,
)
from test_hosts import in_host, veth_pair
from support import end_all, read_lines

# A collective stuck between the pods ends within 60 s with a line that names it
BOUNDED = ["--dist-timeout", "60"]
SMALL_SHM = ["sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]  # a pod's, without a volume
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` of the manifests
SCRIPT = "train_ddp_torchrun.py"


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """{"a": (namespace, address, interface), "b": ...}: two pods joined by a veth pair, and a hosts file that gives
    each the names its engines resolve to it (a pod's own name, a Service's, a SLURM node's)."""
    with veth_pair("en", 78) as made:
        hosts_file = tmp_path_factory.mktemp("pods") / "hosts"
        hosts_file.write_text(
            "127.0.0.1 localhost\n"
            + "".join(  # (a pod's hosts file holds its own names)
                f"{made[which][1]} resnet-{pytorchjob} resnet-elastic-worker-{n} resnet-node-0-{n}.resnet "
                f"resnet-node-0-{n} node{n + 1}\n"
                for n, (which, pytorchjob) in enumerate((("a", "master-0"), ("b", "worker-0")))
            )
        )
        yield {**made, "hosts": hosts_file}


# ------------------------------------------------------------------------------ what each engine sets, per pod
def pytorchjob_env(replica, index, nproc_per_node="auto", replicas=2):
    """training-operator v1.9, pkg/controller.v1/pytorch (envvar.go, master.go) for a job "resnet" with a Master and
    a Worker: the Master's Service name and port, WORLD_SIZE = replicas x nprocPerNode (1 unless a number), RANK =
    the pod's index (workers after the master), PET_* for torchrun; nprocPerNode defaults to "auto"."""
    rank = index + (replica == "worker")
    world_size = replicas * (int(nproc_per_node) if nproc_per_node.isdigit() else 1)
    return {
        "MASTER_ADDR": "resnet-master-0",
        "MASTER_PORT": "23456",
        "PET_MASTER_ADDR": "resnet-master-0",
        "PET_MASTER_PORT": "23456",
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc_per_node,
        "PET_NNODES": str(replicas),
        "PYTHONUNBUFFERED": "1",
    }


def elastic_env():
    """The same with elasticPolicy (elastic.go) and no Master: only PET_* (the endpoint is worker 0's Service) and,
    from the manifest's env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE."""
    return {
        "PET_RDZV_ENDPOINT": "resnet-elastic-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:2",
        "PET_MAX_RESTARTS": "1",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_ID": "resnet-elastic",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def trainjob_env(index):
    """Kubeflow Trainer v2, pkg/runtime/framework/plugins/torch (torch.go): five PET_* variables and nothing else
    (the master is node 0's pod, <job>-node-0-0.<job>, port 29500); TORCH_DISABLE_SHARE_RDZV_TCP_STORE is the
    manifest's trainer.env."""
    return {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": "resnet-node-0-0.resnet",
        "PET_MASTER_PORT": "29500",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def srun_env(task):
    """What srun gives each task of `srun python` with --nodes=2 --ntasks-per-node=1 (src/common/env.c, srun(1))."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(task),
    }


def pod(pods, which, hostname, engine_env, command):
    """command in pod `which` ("a" or "b"), with its hostname, the shared hosts file, the engine's variables and the
    64 MB /dev/shm that a pod has unless a volume is mounted there."""
    return in_host(
        pods[which],
        [*SMALL_SHM, "env", *(f"{k}={v}" for k, v in engine_env.items()), *command],
        hostname,
        pods["hosts"],
    )


def train(tmp_path, *extra):
    return [
        SCRIPT,
        *DEFAULTS,
        *BOUNDED,
        "--data-path",
        str(extra[0]),
        "--output-dir",
        str(tmp_path / "run"),
        "--resume",
        "auto",
        *extra[1:],
    ]


# ------------------------------------------------------------------- each engine trains as one machine would
ENGINES = {  # name: (pod a, pod b), each (hostname, environment, launcher)
    "pytorchjob-torchrun": (
        ("resnet-master-0", pytorchjob_env("master", 0, "1"), TORCHRUN),
        ("resnet-worker-0", pytorchjob_env("worker", 0, "1"), TORCHRUN),
    ),
    "pytorchjob-python": (
        ("resnet-master-0", pytorchjob_env("master", 0), [sys.executable]),
        ("resnet-worker-0", pytorchjob_env("worker", 0), [sys.executable]),
    ),
    "trainjob-v2": (("resnet-node-0-0", trainjob_env(0), TORCHRUN), ("resnet-node-0-1", trainjob_env(1), TORCHRUN)),
    "srun-python": (("node1", srun_env(0), [sys.executable]), ("node2", srun_env(1), [sys.executable])),
}


def test_torchs_launcher_api_from_python_trains_as_torchrun_does(default_ddp, tiny_data, tmp_path):
    """docs/running.md's launch.py, as the page has it, beside a copy of train_ddp_torchrun.py: elastic_launch from
    Python (its processes started by spawn, the loader workers still forked) ends bitwise where `bash run.sh ddp 2`
    with the same flags ends (default_ddp), every flag's default from get_args_parser(), the threads shared out as
    run.sh does; main() returned None on both ranks."""
    code = re.search(r"```python\n(# launch\.py.*?)```", (REPO / "docs" / "running.md").read_text(), re.S)[1]
    copy_rung("ddp", tmp_path)
    (tmp_path / "launch.py").write_text(code)
    env = {name: value for name, value in job_env().items() if name != "OMP_NUM_THREADS"}  # launch.py's to set
    ended = run(
        [sys.executable, "launch.py", *DEFAULTS, "--data-path", str(tiny_data), "--output-dir", "run"],
        cwd=tmp_path,
        env=env,
    )
    assert ended.returncode == 0, ended.stdout[-2000:] + ended.stderr[-2000:]
    assert ended.stdout.splitlines()[-1] in ("{0: None, 1: None}", "{1: None, 0: None}"), ended.stdout[-2000:]
    assert "global batch 16 = 8 per process x 2 processes" in ended.stdout
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(default_ddp / "last.pt"))


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_started_its_way_trains_as_one_machine_does(engine, pods, default_ddp, tiny_data, tmp_path):
    """Two pods (nodes) of one process each, as the engine starts them, equal one machine with 2 processes and the
    same settings, bitwise: the ranks, LOCAL_RANK and the master come from the engine's variables alone. With the
    loader workers a user gets, in a pod's 64 MB /dev/shm (their batches fit)."""
    commands = [
        pod(pods, which, hostname, env, [*launcher, *train(tmp_path, tiny_data)])
        for which, (hostname, env, launcher) in zip("ab", ENGINES[engine])
    ]
    results = run_together(commands, timeout=240)
    assert [node.returncode for node in results] == [0, 0], results
    output = results[0].stdout + results[1].stdout
    assert output.count("global batch 16 = 8 per process x 2 processes") == 1, output
    assert not any("Traceback" in node.stderr or "error:" in node.stderr for node in results), results
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(default_ddp / "last.pt"))
    print(f"{engine}: {max(node.seconds for node in results):.1f} s")


def test_pytorchjob_python_refuses_several_processes_per_pod_and_a_master_that_never_answers(pods, tiny_data, tmp_path):
    """Plain python with nprocPerNode 8 (WORLD_SIZE counts 8 per pod) would wait for processes nobody starts; a
    worker pod whose master never answers would wait, then print dozens of C++ lines. One line each, within
    --dist-timeout."""
    command = [
        sys.executable,
        SCRIPT,
        *DEFAULTS,
        *f"--dist-timeout 5 --data-path {tiny_data} --output-dir {tmp_path / 'run'}".split(),
    ]
    several, silent = run_together(
        [pod(pods, "b", "resnet-worker-0", pytorchjob_env("worker", 0, nproc), command) for nproc in ("8", "auto")],
        timeout=120,
    )
    for node, expected in [
        (
            several,
            "error: WORLD_SIZE 16 for 2 pods, but python starts one process per pod: start the pod's "
            "command with torchrun (it reads PET_*)",
        ),
        (
            silent,
            "error: rank 1 cannot reach MASTER_ADDR:MASTER_PORT resnet-master-0:23456 within "
            "--dist-timeout 5 s (Connection refused): check both, and that rank 0 (the master pod, the "
            "first task) runs",
        ),
    ]:
        assert node.returncode == 1 and node.stderr.strip() == expected and node.stdout == "", node
        assert node.seconds < 5 + 40, node.seconds  # torch's import comes first
    assert not (tmp_path / "run").exists()


def test_an_elastic_pytorchjob_restarts_a_killed_worker_in_one_pod_and_resumes(pods, default_ddp, tiny_data, tmp_path):
    """elasticPolicy: torchrun in each pod with c10d rendezvous at worker 0, max 1 restart, the manifest's
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE. The worker in pod b is killed mid-epoch: pod b's agent restarts it (a
    failure), pod a's its own (a membership change), they meet again and resume from the last checkpoint, and the
    job ends with the uninterrupted weights."""
    command = [*TORCHRUN, *train(tmp_path, tiny_data, "--save-every", "1")]
    jobs = [
        start(
            pod(pods, which, f"resnet-elastic-worker-{n}", elastic_env(), command),
            timeout=300,
            env={**job_env(), "LOGLEVEL": "INFO"},
        )
        for n, which in enumerate("ab")
    ]
    outputs = [[], []]
    readers = [read_lines(job, out) for job, out in zip(jobs, outputs)]
    try:
        deadline = time.time() + 180
        while not any("epoch 1/2  step 2/3" in line for out in outputs for line in out):
            assert time.time() < deadline and all(job.poll() is None for job in jobs), outputs
            time.sleep(0.05)
        os.kill(next(iter(ranks(jobs[1]).values())), signal.SIGKILL)
        for job in jobs:
            job.wait(timeout=180)
    finally:
        end_all(jobs, readers)
    text = ["".join(out) for out in outputs]
    assert [job.returncode for job in jobs] == [0, 0], [t[-3000:] for t in text]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in text[1], text[1][-3000:]
    assert "Worker group FAILED" not in text[0], text[0][-3000:]
    resumed = [t for t in text if "resuming from" in t]
    assert len(resumed) == 1, text
    assert assert_resumed_after(resumed[0])[0] in (2, 3, 4), resumed[0][-3000:]  # after step 1, 2 or 3
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(default_ddp / "last.pt"))


# --------------------------------------------------------------------------------------- a pod's /dev/shm
def in_small_shm(command):
    """command with a 64 MB /dev/shm of its own, as a Kubernetes pod has unless a volume is mounted there."""
    return ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh", *command]


@pytest.fixture(scope="module")
def small_shm():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a private /dev/shm")
    probe = subprocess.run(in_small_shm(["df", "-k", "/dev/shm"]), capture_output=True, text=True, timeout=30)
    if probe.returncode:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.strip()}")


def test_a_64_mb_dev_shm_too_small_for_the_loader_workers_is_refused_in_one_line(small_shm, tiny_data, tmp_path):
    """Two workers per process, batches of 4 720-pixel images: the training loader's workers hold 5 batches in
    /dev/shm (62 MB for the 2 processes, which fit), the validation loader's persistent workers 4 more all along
    (112 MB in all, which do not). Counting the training loader alone, the check let the job start, and it failed at
    its first batches with tracebacks of 100 lines (`unable to allocate shared memory`); now one line says what to
    mount, and the --workers that fits, before any batch is read. (The defaults fit: the engine tests above.)"""
    started = time.time()
    big = run(
        in_small_shm(
            [
                "bash",
                "run.sh",
                "ddp",
                2,
                *f"--data-path {tiny_data} --epochs 1 -j 2 -b 4 --img-size 720 --val-fraction 0.25".split(),
                *f"--output-dir {tmp_path / 'big'}".split(),
            ]
        ),
        env=job_env(),
        timeout=240,
    )
    errors = [line for line in big.stderr.splitlines() if line.startswith("error:")]
    assert big.returncode == 1 and errors == [
        "error: /dev/shm holds 64 MiB, too little for the batches of 2 loader workers per process: mount a "
        "memory-backed volume there (Kubernetes: an emptyDir with medium: Memory, see examples/; docker run "
        "--shm-size=8g), or use --workers 0"
    ], big.stderr[-3000:]
    assert "Traceback" not in big.stderr and "  step " not in big.stdout, big.stderr[-3000:]
    assert time.time() - started < 90
    assert not (tmp_path / "big" / "last.pt").exists()


def test_doctor_names_the_engine_and_the_pods_dev_shm(small_shm):
    """In a pod of an elastic PyTorchJob whose manifest forgot the store variable, with a 64 MB /dev/shm."""
    env = {
        k: v
        for k, v in {**job_env(), **elastic_env(), "KUBERNETES_SERVICE_HOST": "10.96.0.1"}.items()
        if k not in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "MASTER_ADDR", "MASTER_PORT")
    }
    result = run(in_small_shm(["bash", "run.sh", "doctor", "--no-allreduce"]), env=env, timeout=120)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr  # the missing variable is a failed check
    assert (
        "fail  engine: Kubeflow PyTorchJob, elastic (c10d rendezvous at resnet-elastic-worker-0:23456, "
        "PET_NNODES 1:2, PET_MAX_RESTARTS 1): start torchrun, which reads PET_*; restarts on several pods need "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the scripts refuse without it): add it to the container's env "
        "(examples/)"
    ) in lines, lines
    shm = [line for line in lines if "/dev/shm 64 MiB" in line]
    assert len(shm) == 1 and shm[0].startswith("warn  ") and "emptyDir with medium: Memory" in shm[0], lines


# ------------------------------------------------------------------------------------------- the manifests
def read_yaml(text):
    """The YAML the manifests are written in, read without a YAML library: block mappings and sequences, plain and
    double-quoted scalars, comments, and &anchor / *alias as a mapping's value. Anything else raises, so that a
    manifest cannot drift out of what this reads (kubectl reads all of YAML)."""
    lines, anchors = [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.strip():
            lines.append([len(line) - len(line.lstrip(" ")), line.strip(), number])
    key_line = re.compile(r"([^\s:\-\"'][^:]*?):(?:\s+(.+))?")

    def scalar(text, number):
        if text.startswith("*"):
            return anchors[text[1:]]
        if re.fullmatch(r'"[^"\\]*"', text):
            return text[1:-1]
        if re.match(r"[\[{&!|>'\"%@`]", text) or ": " in text:
            raise ValueError(f"line {number}: {text!r} is outside the YAML subset the manifests use")
        return int(text) if re.fullmatch(r"-?\d+", text) else text

    def node(i, indent):
        """(the value whose lines start at lines[i] with this indentation, the index after it)"""
        if lines[i][1] == "-" or lines[i][1].startswith("- "):
            items = []
            while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("-"):
                lines[i][0:2] = [indent + 2, lines[i][1][1:].strip()]  # the item, as a node 2 columns in
                item, i = node(i, indent + 2)
                items.append(item)
            return items, i
        if not key_line.fullmatch(lines[i][1]):
            return scalar(lines[i][1], lines[i][2]), i + 1
        mapping = {}
        while i < len(lines) and lines[i][0] == indent:
            match = key_line.fullmatch(lines[i][1])
            if not match or match[1] in mapping:
                raise ValueError(f"line {lines[i][2]}: {lines[i][1]!r}: not a new key of this mapping")
            key, value, number, i = match[1], match[2], lines[i][2], i + 1
            anchor = value[1:] if value and value.startswith("&") else None
            if value is None or anchor:
                if i == len(lines) or lines[i][0] <= indent:
                    raise ValueError(f"line {number}: {key}: an empty value")
                value, i = node(i, lines[i][0])
            else:
                value = scalar(value, number)
            mapping[key] = value
            if anchor:
                anchors[anchor] = value
        if i < len(lines) and lines[i][0] > indent:
            raise ValueError(f"line {lines[i][2]}: unexpected indentation")
        return mapping, i

    document, end = node(0, lines[0][0])
    assert end == len(lines) and lines[0][0] == 0
    return document


def test_the_yaml_reader_reads_what_it_claims_and_refuses_the_rest():
    text = 'a: 1\nb:\n  - x\n  - c: "2"\n    d: e:f  # comment\nt: &t\n  k: v\nu: *t\n'
    assert read_yaml(text) == {"a": 1, "b": ["x", {"c": "2", "d": "e:f"}], "t": {"k": "v"}, "u": {"k": "v"}}
    for bad in ("a: [1, 2]\n", "a: {b: 1}\n", "a: |\n  x\n", "a: 1\na: 2\n", "a:\n  b: 1\n c: 2\n", "a: 'x'\n"):
        with pytest.raises(ValueError):
            read_yaml(bad)


EXAMPLES = REPO / "examples"


def flags_known(command):
    """Every --flag of the script's command line is one the torchrun rung (or utils.py's parser, or the built-in
    task's in builtin.py) declares."""
    sources = [(REPO / name).read_text() for name in (SCRIPT, "utils.py", "builtin.py")]
    calls = re.findall(r"add_argument\(([^)]*)", "".join(sources))
    declared = {flag for call in calls for flag in re.findall(r'"(--[\w-]+)"', call)}
    flags = {arg.split("=")[0] for arg in command if arg.startswith("--")}
    assert flags and flags <= declared, flags - declared
    return dict(arg.split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def check_pod(pod_spec, container, command):
    """What every Kubernetes pod of ours needs: a memory-backed /dev/shm, the output folder on a shared claim, the
    store variable, resource limits, torchrun on the torchrun rung, --resume auto."""
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert command[:2] == ["torchrun", SCRIPT], command
    args = flags_known(command[2:])
    assert args["--resume"] == "auto"
    shared = [path for path, volume in mounts.items() if "persistentVolumeClaim" in volume]
    assert any(args["--output-dir"].startswith(path + "/") for path in shared), (args, shared)
    assert any(args["--data-path"].startswith(path + "/") for path in shared), (args, shared)
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert {"nvidia.com/gpu", "cpu", "memory"} <= set(container["resources"]["limits"]), container["resources"]


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "pytorchjob-elastic.yaml"])
def test_the_pytorchjob_manifests_carry_what_the_scripts_need(name):
    job = read_yaml((EXAMPLES / name).read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    elastic = job["spec"].get("elasticPolicy")
    assert set(replicas) == ({"Worker"} if elastic else {"Master", "Worker"})
    if elastic:  # torchrun restarts workers across pods: only safe with a fresh store each time (checked below)
        assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] > 0 and elastic["maxReplicas"] > 1
    assert job["spec"]["runPolicy"]["backoffLimit"] > 0
    for replica in replicas.values():
        assert replica["restartPolicy"] == "OnFailure"  # not ExitCode: a rank that sees its peer die exits 1
        spec = replica["template"]["spec"]
        (container,) = spec["containers"]
        assert container["name"] == "pytorch"  # where the operator sets its variables and looks for the port
        assert [port["name"] for port in container["ports"]] == ["pytorchjob-port"]
        assert spec["terminationGracePeriodSeconds"] >= 60  # time to stop at an agreed step and save
        check_pod(spec, container, container["command"])


def test_the_trainjob_manifest_carries_what_the_scripts_need():
    job = read_yaml((EXAMPLES / "trainjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] > 1 and trainer["numProcPerNode"] >= 1
    names = {item["name"] for item in trainer["env"]}
    assert not names & {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node"
    spec = replicated["template"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["name"] == "node"  # the runtime's container: Trainer puts trainer.env and PET_* there
    check_pod(spec, {**container, "env": trainer["env"], "resources": trainer["resourcesPerNode"]}, trainer["command"])


def test_the_torchx_command_carries_what_the_scripts_need():
    text = (EXAMPLES / "torchx.sh").read_text()
    assert subprocess.run(["bash", "-n", EXAMPLES / "torchx.sh"], timeout=10).returncode == 0
    words = shlex.split(text[text.index("torchx run") :].replace("\\\n", " "), comments=True)
    assert words[:4] == ["torchx", "run", "--scheduler", "kubernetes"] and "dist.ddp" in words
    options = dict(zip(words[: words.index("--")], words[1 : words.index("--")]))
    assert int(options["--max_retries"]) > 0 and options["-j"] == "2x8"
    assert {"--gpu", "--cpu", "--memMB"} <= set(options) and options["--script"] == SCRIPT
    assert options["--env"] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    mount = dict(item.split("=") for item in options["--mounts"].split(","))
    assert mount["type"] == "volume"  # a claim every pod shares; TorchX mounts a memory-backed /dev/shm itself
    args = flags_known(words[words.index("--") + 1 :])
    assert args["--resume"] == "auto" and args["--output-dir"].startswith(mount["dst"] + "/")


def test_the_sbatch_file_asks_one_task_per_gpu_and_requeues_with_resume_auto():
    """What the file says, read (bash -n and its lines): no SLURM here to run it or requeue it; the "srun-python"
    engine above starts the script as srun would, and proves the script's side."""
    text = (EXAMPLES / "sbatch.sh").read_text()
    assert subprocess.run(["bash", "-n", EXAMPLES / "sbatch.sh"], timeout=10).returncode == 0
    sbatch = dict(re.findall(r"^#SBATCH (--[\w-]+)(?:=(\S+))?", text, re.M))
    assert sbatch["--ntasks-per-node"] == sbatch["--gpus-per-node"]  # one task per GPU, each sees its node's GPUs
    assert {"--cpus-per-task", "--mem", "--time", "--requeue", "--signal"} <= set(sbatch)
    assert "--gpus-per-task" not in sbatch
    srun = shlex.split(re.search(r"^srun python .*?(?<!\\)$", text, re.M | re.S)[0].replace("\\\n", " "))
    assert srun[:3] == ["srun", "python", SCRIPT], srun
    flags_known(srun[3 : srun.index("||")])
    assert srun[srun.index("--resume") + 1] == "auto" and "$SLURM_JOB_ID" in srun[srun.index("--output-dir") + 1]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
