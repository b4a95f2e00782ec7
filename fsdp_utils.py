# SPDX-License-Identifier: BSD-3-Clause
"""Helpers only train_fsdp.py needs, beside dist_utils.py: its sharded checkpoints checked (each file's CRC, written
beside them) and read without running code from them, the bytes each rank's shards hold, an EMA updated shard by
shard, and the process group let go of at once on every exit."""

import contextlib
import gc
import io
import json
import pickle
import re
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh

import dist_utils
import guards
from guards import UsageError, first_line
from utils import write_json

CHECKSUMS = "checksums.json"  # in a shard folder: each file's size and CRC-32 (torch's shards carry none)


@contextlib.contextmanager
def one_line_errors():
    """dist_utils.one_line_errors(), and after it destroys the process group, what FSDP keeps of the group let go of
    (release_meshes): train_fsdp.py's __main__."""
    try:
        with dist_utils.one_line_errors(sharded_checkpoint_failure):
            yield
    finally:
        release_meshes()


def sharded_checkpoint_failure(error):
    """The line for a failure of the sharded checkpoint that every rank meets alike, or None."""
    text = str(error)
    folder = guards.run_dir()
    if "unexpected pos" in text and folder:  # torch.save's write failed: in dcp.save (FSDP's shards)
        return (
            f"cannot write the sharded checkpoint into {folder} ({shutil.disk_usage(folder).free >> 20} MiB left on "
            f"its disk): free space, then continue with --resume auto (last.pt and the shards it names are intact)"
        )
    if "Weights only load failed" in text:  # an item of a sharded checkpoint (SafeLoadPlanner)
        return (
            "--resume: the sharded checkpoint holds Python objects besides tensors and plain types, and loading "
            "them could run code: refused; resume from a folder that these scripts wrote"
        )
    if "Missing key in checkpoint state_dict: optimizer." in text:  # another run's trained parameters
        return guards.OTHER_OPTIMIZER_STATE
    return None


def release_meshes():
    """After dist.destroy_process_group(), the group lives on in every DeviceMesh (its private _pg_registry; DTensor's
    caches hold the meshes) and in FSDP's reference cycles: it would be torn down while the interpreter exits, where
    gloo's teardown aborted an FSDP rank now and then (docs/fsdp.md). Let go of it now."""
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:  # (isinstance: warnings)
        with contextlib.suppress(Exception):  # a private attribute (torch 2.14, device_mesh.py): best effort
            mesh._pg_registry.clear()
    gc.collect()  # FSDP's hooks hold the modules, and through them the group, in reference cycles


CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def units(model):
    """FSDP's units of a model, each sharded and gathered whole (its size bounds the memory): its repeated blocks,
    the outermost ones (two or more modules of one class, each made of modules, side by side in a ModuleList,
    ModuleDict or Sequential: a ResNet's residual blocks, a transformer's layers, nanoGPT's `h`, torchvision's ViT
    `encoder.layers`, Hugging Face's `layers`); a model without any, each child that holds parameters, a container's
    children in its place (fully_shard refuses a ModuleList, whose forward does nothing). What is left (embeddings, a
    head, weights tied between them) stays with the root."""

    def repeated_blocks(module):
        if isinstance(module, CONTAINERS):
            blocks = [child for child in module.children() if list(child.children())]
            kinds = [type(block) for block in blocks]
            if any(kinds.count(kind) > 1 for kind in kinds):
                return [block for block in blocks if kinds.count(type(block)) > 1]
        return [block for child in module.children() for block in repeated_blocks(child)]

    def children(module):
        for child in module.children():
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                yield from children(child)
            elif list(child.parameters()):
                yield child

    return repeated_blocks(model) or list(children(model))


def update_average(averaged, model):
    """averaged.update_parameters(model) (torch's AveragedModel) where both are sharded: each rank updates its own
    shards. Their parameters are DTensors and their buffers plain tensors, which one foreach op refuses to mix unless
    the plain ones count as replicated (implicit_replication)."""
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        averaged.update_parameters(model)


def shard_bytes(model, optimizer):
    """Bytes of this rank's shards of the parameters, gradients and optimizer state (AdamW's step counts are
    plain tensors, on every rank)."""

    def local(tensor):
        """A DTensor's shard on this rank; a plain tensor as it is."""
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    return {
        name: sum(local(t).nbytes for t in tensors if t is not None)
        for name, tensors in (
            ("params", list(model.parameters())),
            ("grads", [p.grad for p in model.parameters()]),
            ("optimizer", [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]),
        )
    }


def write_checksums(folder):
    """CHECKSUMS for the files of a shard folder that dcp.save has finished (every rank's shards written)."""
    write_json(Path(folder) / CHECKSUMS, {path.name: size_and_crc(path) for path in sorted(Path(folder).iterdir())})


def size_and_crc(path):
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return [path.stat().st_size, crc]


def sharded_checkpoint(run_dir, name):
    """FSDP: the folder of a last.pt's shards, as a reader for dcp.load that runs no code from it. The name comes from
    last.pt: it must be a folder of the same run folder."""
    folder = Path(run_dir) / str(name)
    if not (
        re.fullmatch(r"last-[\w.-]+\.dcp", str(name))
        and folder.is_dir()
        and folder.resolve().parent == Path(run_dir).resolve()
    ):
        raise UsageError(
            f"--resume {Path(run_dir) / 'last.pt'}: its shards, {str(name)[:80]!r}, are not a folder "
            f"beside it; resume from a last.pt that train_fsdp.py wrote, or start from --weights"
        )
    return SafeReader(folder)


class SafeReader(dcp.FileSystemReader):
    """torch's reader of a sharded checkpoint reads its .metadata with pickle.load, and the items that are not tensors
    (the optimizer's settings) with torch.load(weights_only=False): either could run code from a crafted folder.
    This one admits in the metadata only the checkpoint's own types, and loads the items with weights_only=True (its
    planner). The metadata is read here, on every rank alike: a refused folder ends in one line."""

    TYPES = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    }

    def __init__(self, folder):
        super().__init__(folder)
        best = Path(folder).parent / "best.pt"
        fallback = f"; {best} holds the best epoch's weights: start from them with --weights {best}"
        fallback = fallback if best.is_file() else ""
        if (Path(folder) / CHECKSUMS).is_file():  # (a folder written before they were: its metadata is checked below)
            for name, expected in json.loads((Path(folder) / CHECKSUMS).read_text()).items():
                path = Path(folder) / Path(name).name
                if not path.is_file() or size_and_crc(path) != expected:
                    raise UsageError(
                        f"--resume: the shard file {Path(folder).name}/{path.name} is damaged or missing (its size "
                        f"or CRC is not the one written beside it){fallback}"
                    )
        try:
            with open(Path(folder) / ".metadata", "rb") as f:
                self.metadata = self.Unpickler(f).load()
            files = [info.relative_path for info in self.metadata.storage_data.values()]
        except Exception as error:
            raise UsageError(
                f"--resume: {folder}/.metadata was refused ({first_line(error)}); resume from a sharded "
                f"checkpoint that these scripts wrote"
            ) from None
        strays = [name for name in files if Path(name).name != name or name in ("", ".", "..")]
        if strays:
            raise UsageError(f"--resume: {folder}/.metadata names a file outside its folder ({strays[0][:80]!r})")
        # Every piece the metadata names must lie within its file: a shard cut short (a full disk, a copy interrupted)
        # is one line here, on every rank alike, not a failure deep in dcp.load
        sizes = {}
        for info in self.metadata.storage_data.values():
            name = info.relative_path
            if name not in sizes:
                sizes[name] = (Path(folder) / name).stat().st_size if (Path(folder) / name).is_file() else -1
            if info.offset + info.length > sizes[name]:
                raise UsageError(
                    f"--resume: the shard {Path(folder).name}/{name} is cut short or missing ({max(sizes[name], 0)} "
                    f"bytes, its pieces reach {info.offset + info.length}){fallback}"
                )
        self.planner = SafeLoadPlanner()

    def read_metadata(self, *args, rank=None, **kwargs):
        if rank is not None:  # a rank's own metadata, which these scripts never write
            raise FileNotFoundError(f"no metadata of rank {rank}")
        self.metadata.storage_meta = self.metadata.storage_meta or dcp.metadata.StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    class Unpickler(pickle.Unpickler):
        """pickle's, admitting only TYPES and torch's dtypes."""

        def find_class(self, module, name):
            if name in SafeReader.TYPES.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            ):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not a type of a checkpoint's metadata")


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """dcp's planner, but the items that are not tensors (the optimizer's settings) load with weights_only=True."""

    def load_bytes(self, read_item, value):
        """The item loaded with weights_only=True, and handed on as torch's own copy of it."""
        safe = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)
