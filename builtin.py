# SPDX-License-Identifier: BSD-3-Clause
"""The built-in data and model that each script's build_datasets() and build_model() use by default: image folders
(--data-path, or the generated demo data) read as uint8 tensors with their augmentation, and torchvision's ResNet
with its ImageNet weights (--model, --weights, --freeze). Yours replace them; then this file is not needed."""

import argparse
import contextlib
import gc
import hashlib
import math
import os
import re
import shutil
import urllib.parse
import warnings
from pathlib import Path

import numpy
import torch
from PIL import Image
from torch.utils.data import Dataset

import guards
import utils
from guards import BadImageError, UsageError

collecting = gc.isenabled()
gc.disable()  # torchvision's import makes ~150,000 objects that live on: collecting among them costs ~0.3 s a process
import torchvision
import torchvision.transforms.v2.functional as TF

if collecting:  # as it was: importing builtin changes nothing in your program
    gc.enable()

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm", ".pgm")
DEMO_DIR = Path(__file__).resolve().parent / "data" / "demo"
DEMO_CLASSES = ("checkers", "disc", "hstripes", "rings", "vstripes")

try:  # TorchCodec: PyTorch's image decoder (torchvision.io's is deprecated); PIL where it is not installed
    from torchcodec.decoders import decode_image as codec_decode, decode_jpeg as codec_jpeg

    codec_missing = None
except Exception as error:  # not installed, or built for another torch: datasets() says so
    codec_decode = codec_jpeg = None
    codec_missing = guards.first_line(error)


MODELS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


def add_arguments(parser):
    """The built-in task's flags: the image folders' and the ResNet's."""
    parser.add_argument(
        "--data-path",
        action=DataPath,
        help="folder of class sub-folders, or of train/ and val/ class folders "
        "(default: the built-in demo data, generated into data/demo on first use); with it, --epochs defaults to 30",
    )
    parser.add_argument("--img-size", type=int, help="training crop size (default: 64 on the demo data, 224 otherwise)")
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.2,
        help="share of each class held out for validation when --data-path has no train/ and val/ folders",
    )
    parser.add_argument("--model", default="resnet18", choices=MODELS)
    parser.add_argument(
        "--weights",
        help="initial weights: a local torchvision state dict or one of our checkpoints, "
        "or torchvision's name for --model's (DEFAULT, IMAGENET1K_V1, ...), downloaded once",
    )
    parser.add_argument(
        "--freeze",
        action="store_true",
        help="train only the classifier head; backbone frozen and its BatchNorm in eval mode",
    )
    # The demo's epochs. A default given as a string is converted (by type=int) only where the flag was not given:
    # DataPath tells the two apart, and makes it 30 for a folder of yours.
    parser.set_defaults(epochs="12")


class DataPath(argparse.Action):
    """--data-path: also --epochs 30 where --epochs is not given (before or after it): photos take longer to learn
    than the demo's textures (docs/data.md)."""

    def __call__(self, parser, namespace, value, option_string=None):
        if not value.strip():  # --data-path "$DATA" with DATA unset: not the demo data, silently
            raise UsageError("--data-path is empty (an unset shell variable?): give a folder of class sub-folders")
        namespace.data_path = value
        if isinstance(namespace.epochs, str):  # still the default: --epochs not given so far
            namespace.epochs = 30


def datasets(args):
    """(training set, validation set, class names) from --data-path, or from the demo data."""
    if not 0 < args.val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    img_size = args.img_size or (64 if args.data_path is None else 224)
    batch = getattr(args, "batch_size", 1)
    batch_bytes = batch * 3 * img_size**2 * 4  # a batch of float images, before any activation
    if batch_bytes > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        raise UsageError(
            f"--img-size {img_size}: a batch of {batch} such images takes {batch_bytes / 2**30:.0f} GiB, "
            f"more than this machine's memory; give a smaller --img-size (224 is ImageNet's)"
        )
    if codec_missing and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"warning: TorchCodec cannot be imported ({codec_missing}): the images are decoded with PIL, slower on "
            f"small images; pip install -r requirements.txt",
            flush=True,
        )
    classes, train_files, val_files = find_images(args.data_path or demo_data(), args.val_fraction)
    train_set = ImageFiles(train_files, img_size, train=True)
    val_set = ImageFiles(val_files, img_size, train=False)
    return train_set, val_set, classes


# ------------------------------------------------------------------------------------------ image folders
def find_images(data_path, val_fraction):
    """(class names, training files, validation files) from a folder of class sub-folders (split per class by
    val_fraction, the same split whatever --seed) or a folder holding train/ and val/ class folders."""
    root = Path(data_path)
    if not root.is_dir():
        raise UsageError(f"--data-path {data_path}: not a directory; give a folder of class sub-folders")
    if (root / "train").is_dir() and (root / "val").is_dir():
        classes, train = scan_classes(root / "train")
        val_classes, val = scan_classes(root / "val")
        unknown = sorted(set(val_classes) - set(classes))
        if unknown:
            raise UsageError(f"{root / 'val'} has classes missing from {root / 'train'}: {', '.join(unknown)}")
        index = {name: i for i, name in enumerate(classes)}
        val = [(path, index[val_classes[label]]) for path, label in val]
    else:
        classes, found = scan_classes(root)
        per_class = [[] for _ in classes]
        train = []
        val = []
        for path, label in found:  # one pass: start-up stays linear in the number of files
            per_class[label].append(path)
        for label, files in enumerate(per_class):
            order = torch.randperm(len(files), generator=torch.Generator().manual_seed(label)).tolist()
            n_val = round(val_fraction * len(files))
            val += [(files[i], label) for i in sorted(order[:n_val])]
            train += [(files[i], label) for i in sorted(order[n_val:])]
    for split, name, fix in ((val, "validation", "raise"), (train, "training", "lower")):
        if not split:
            raise UsageError(f"the {name} split of {root} is empty; {fix} --val-fraction or add images")
    return classes, FileList(train, root), FileList(val, root)


def scan_classes(root):
    """(class names, [(path, label)]) of root/<class>/**/<image file>, hidden files and folders left out."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise UsageError(f"no class sub-folders in {root}; expected {root}/<class name>/<image files>")
    if len(classes) < 2:
        raise UsageError(f"only one class ({classes[0]}) in {root}; a classifier needs at least 2 class folders")
    # A class folder that is a link to the data folder, or to another class's, would hold those images again
    real = {name: (root / name).resolve() for name in classes}
    linked = [name for name in classes if (root / name).is_symlink()]
    for name in linked:
        if real[name] == root.resolve() or real[name] in root.resolve().parents:
            raise UsageError(
                f"class folder {root / name} is a link to {real[name]}, which holds the data folder: remove it"
            )
    for name in linked:
        path = real[name]
        for other, elsewhere in real.items():
            if other != name and (path == elsewhere or elsewhere in path.parents):
                raise UsageError(
                    f"class folder {root / name} is a link into class {other} ({path}): its images would be in "
                    f"two classes; remove the link, or copy the images"
                )
    found = []
    for label, name in enumerate(classes):
        files = []
        for folder, subfolders, names in os.walk(root / name):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
            files += [
                os.path.join(folder, f)
                for f in sorted(names)
                if not f.startswith(".") and f.lower().endswith(IMAGE_EXTENSIONS)
            ]
        if not files:
            raise UsageError(
                f"class folder {root / name} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
                f"add some or remove the folder"
            )
        found += [(f, label) for f in files]
    return classes, found


class FileList:
    """A read-only list of (path, label) pairs in two numpy arrays: a list of tuples is written to by every read
    (reference counts), so each forked loader worker would copy it (217 MB for ImageNet's paths)."""

    def __init__(self, pairs, root=""):
        # as bytes: fsencode/fsdecode round-trip undecodable file names
        self.paths = numpy.array([os.fsencode(path) for path, _ in pairs], dtype=bytes)
        self.labels = numpy.array([label for _, label in pairs], dtype=numpy.int64)
        self.root = os.fsencode(root)  # the data folder, left out of the fingerprint: the same data moved is the same

    def fingerprint(self):
        """The files (their paths below the data folder) and labels, in order, hashed."""
        digest = hashlib.sha256(self.labels.tobytes())
        for path in self.paths:
            digest.update(path.removeprefix(self.root) + b"\0")
        return f"{len(self)} files, sha256 {digest.hexdigest()[:16]}"

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return os.fsdecode(self.paths[index]), int(self.labels[index])


class ImageFiles(Dataset):
    """Image files as uint8 tensors (3, size, size); normalize() normalises whole batches on the device. A training
    item's random crop and flip come from torch's generator (SeededItems seeds it per sample)."""

    def __init__(self, files, img_size, train):
        self.files = files
        self.img_size = img_size
        self.train = train
        self.fingerprint = files.fingerprint()  # a resume onto other files or another split is refused (utils.Run)
        if not train:  # how an image is prepared here and by utils.normalize in run_model(): checkpoints keep it,
            # and a prediction that follows it gives the run's own predictions (docs/adapting.md's predict.py)
            self.preprocessing = {
                "image": "RGB, uint8 (3, H, W)",
                "resize": round(img_size * 8 / 7),  # the shorter side, antialiased; then the centre crop
                "center_crop": img_size,
                "mean": list(utils.MEAN),  # per channel, of the pixel values / 255
                "std": list(utils.STD),
            }

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        image, crop = self.decode(index)
        label = self.files[index][1]
        if not self.train:  # the usual evaluation view: resize to 8/7 of the crop, then take the centre
            return TF.center_crop(TF.resize(image, round(self.img_size * 8 / 7), antialias=True), self.img_size), label
        ratio = image.shape[-1] / crop["width"]  # the crop, mapped onto an image decoded smaller (else 1)
        top = round(crop["top"] * ratio)
        left = round(crop["left"] * ratio)
        bottom = round((crop["top"] + crop["height"]) * ratio)
        right = round((crop["left"] + crop["box_width"]) * ratio)
        # TF.resized_crop(..., antialias=True) and TF.horizontal_flip called directly: the same pixels, cheaper
        image = torch.nn.functional.interpolate(
            image[None, :, top:bottom, left:right], size=[self.img_size] * 2, mode="bilinear", antialias=True
        )[0]
        return image.flip(-1) if crop["flip"] else image, label

    def decode(self, index):
        """The file decoded, at the fraction of its size that the crop chosen for it allows: (image, that crop). The
        crop is chosen on the full-size image (width, top, left, height, box_width, flip)."""
        path = self.files[index][0]
        crop = {}

        def scale(height, width):
            """Choose the crop of an image of that size; return 8, 4 or 2 to decode it at that fraction of its size
            (the crop still at least the target size), else 1."""
            if self.train:
                top, left, h, w, flip = random_crop_box(height, width)
            else:  # the whole image, resized and centre-cropped below
                top, left, h, w, flip = 0, 0, height, width, False
            crop.update(width=width, top=top, left=left, height=h, box_width=w, flip=flip)
            target = self.img_size if self.train else round(self.img_size * 8 / 7)
            return next((s for s in (8, 4, 2) if min(h, w) >= s * target), 1)

        image = decode_image(path, scale)  # a JPEG: scale() is given the size from its header before decoding
        if not crop:  # other images: once decoded
            scale(*image.shape[-2:])
        return image, crop

    def large_photo_hint(self):
        """The data-wait hint where the photos are far larger than the crop (the median of 8 files' header sizes)."""
        sides = []
        for i in range(0, len(self), len(self) // 8 or 1):
            with Image.open(self.files[i][0]) as image:  # the header only
                sides.append(min(image.size))
        side = sorted(sides)[len(sides) // 2]  # the median
        if side >= 4 * self.img_size:
            return f"{side} px images for a {self.img_size} px crop: train on a copy from bash run.sh shrink"


def random_crop_box(height, width, generator=None, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3)):
    """RandomResizedCrop's box and a horizontal flip: (top, left, height, width, flip)."""
    for _ in range(10):
        area_u, ratio_u, top_u, left_u, flip_u = torch.rand(5, generator=generator).tolist()
        area = height * width * (scale[0] + area_u * (scale[1] - scale[0]))
        aspect = math.exp(math.log(ratio[0]) + ratio_u * (math.log(ratio[1]) - math.log(ratio[0])))
        w = round(math.sqrt(area * aspect))
        h = round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(top_u * (height - h + 1)), int(left_u * (width - w + 1)), h, w, flip_u < 0.5
    return 0, 0, height, width, flip_u < 0.5


def decode_image(path, scale=None):
    """Any image file as a 3-channel uint8 tensor (grey, palette, RGBA, CMYK: converted; an animation: its first
    frame). scale(height, width) -> 1, 2, 4 or 8, given a JPEG's size from its header: decode at 1/scale in the DCT
    domain (PIL's draft), far cheaper. An image of more pixels than PIL.Image.MAX_IMAGE_PIXELS is refused from its
    header, before anything is decoded (a decompression bomb: a small PNG can hold gigabytes of pixels)."""
    factor = 1
    try:
        with open(path, "rb") as file:
            head = file.read(1 << 20)  # a JPEG's frame header follows its metadata segments (EXIF, ICC: each < 64 KiB)
            jpeg = jpeg_size(head)  # (height, width), or None: another format
            size = jpeg or header_size(path)
            if size and Image.MAX_IMAGE_PIXELS and size[0] * size[1] > Image.MAX_IMAGE_PIXELS:
                raise Image.DecompressionBombError(f"{size[1]} x {size[0]} pixels")
            if size is None:  # no format that PIL knows: nothing more is read
                raise BadImageError(f"cannot decode image {path} (not an image file); remove or replace the file")
            length = os.fstat(file.fileno()).st_size
            if length > 3 * size[0] * size[1] + (16 << 20):  # more than raw pixels and generous metadata
                raise BadImageError(
                    f"image {path} is {length >> 20} MiB for {size[1]} x {size[0]} pixels, more than an image of that "
                    f"size holds (damaged, or not an image); remove or replace the file"
                )
            data = bytearray(head + file.read())  # writable: a tensor shares it (torch.frombuffer)
        if scale and jpeg and min(jpeg):
            factor = scale(*jpeg)
        if codec_decode and factor == 1:  # (a JPEG straight to its decoder: no format detection, 10 % of an item)
            decode = codec_jpeg if jpeg else codec_decode
            image = decode(torch.frombuffer(data, dtype=torch.uint8), mode="RGB")
            return image[0] if image.dim() == 4 else image  # an animated GIF's frames: the first, as PIL gives
    except BadImageError:
        raise
    except Image.DecompressionBombError as error:
        raise BadImageError(
            f"image {path} has {error}, over PIL.Image.MAX_IMAGE_PIXELS ({Image.MAX_IMAGE_PIXELS}): "
            f"refused undecoded, as a possible decompression bomb; for a dataset of such images, raise "
            f"that limit in build_datasets(), or make smaller copies with bash run.sh shrink"
        ) from None
    except Exception:  # a format TorchCodec does not decode (BMP, TIFF, ...): let PIL try before giving up
        pass
    try:
        with Image.open(path) as image:  # (by name: its errors name the file)
            if factor > 1:
                image.draft("RGB", (image.width // factor, image.height // factor))
            return TF.pil_to_tensor(image if image.mode == "RGB" else image.convert("RGB"))  # (a copy otherwise)
    except Exception as error:
        raise BadImageError(f"cannot decode image {path} ({error}); remove or replace the file") from None


def header_size(path):
    """(height, width) of an image that PIL knows, read from its header (nothing decoded), else None. Over twice
    PIL.Image.MAX_IMAGE_PIXELS, PIL itself refuses it here (DecompressionBombError)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # (our check says it, in one line)
            with Image.open(path) as image:
                return image.height, image.width
    except Image.DecompressionBombError as error:  # "Image size (N pixels) exceeds limit of ...": its size
        raise Image.DecompressionBombError(re.search(r"\d+ pixels", str(error))[0]) from None
    except Exception:
        return None


def jpeg_size(data):
    """(height, width) from a JPEG's frame header (an SOFn marker: C0-CF but C4, C8, CC), or None. (PIL's Image.open
    reads it too, at 30 times the cost: a tenth of a 64 px item.)"""
    i = 2 if data[:2] == b"\xff\xd8" else len(data)
    while i + 9 < len(data) and data[i] == 0xFF:
        if 0xC0 <= data[i + 1] <= 0xCF and data[i + 1] not in (0xC4, 0xC8, 0xCC):
            return int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
        if data[i + 1] == 0xFF:  # a fill byte
            i += 1
        else:  # a segment: its marker, then its length (which counts itself)
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")


def demo_data():
    """The built-in demo dataset: 5 classes x 200 JPEGs of 80x80 textures, generated once into data/demo."""
    if not DEMO_DIR.is_dir():
        partial = DEMO_DIR.with_name(f".demo-{os.getpid()}")  # renamed into place: never half-written
        try:
            make_demo_images(partial)
        except OSError as error:  # a read-only checkout (a container's root), a full disk
            shutil.rmtree(partial, ignore_errors=True)
            raise UsageError(
                f"cannot write the demo data into {DEMO_DIR.parent} ({error.strerror or error}): give --data-path "
                f"(a folder of class folders), or run from a checkout that can be written"
            ) from None
        with contextlib.suppress(OSError):  # (another process finished first; its images are identical)
            os.rename(partial, DEMO_DIR)
        shutil.rmtree(partial, ignore_errors=True)
    return DEMO_DIR


def make_demo_images(folder, per_class=200, size=80):
    """Deterministic textures, one kind per class, with random colours, scale, phase and noise."""
    y, x = torch.meshgrid(torch.arange(size) / size, torch.arange(size) / size, indexing="ij")
    for label, name in enumerate(DEMO_CLASSES):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            g = torch.Generator().manual_seed(label * 100_000 + i)
            # drawn in this order: another changes every image
            freq = 2 + 3 * torch.rand(1, generator=g)
            phase = 6.3 * torch.rand(1, generator=g)
            radius = 0.2 + 0.15 * torch.rand(1, generator=g)
            centre = 0.3 + 0.4 * torch.rand(2, generator=g)

            def wave(t, freq=freq, phase=phase):
                return torch.sin(2 * math.pi * freq * t + phase)

            distance = ((x - centre[0]) ** 2 + (y - centre[1]) ** 2).sqrt()
            pattern = {
                "checkers": wave(x) * wave(y) > 0,
                "disc": distance < radius,
                "hstripes": wave(y) > 0,
                "vstripes": wave(x) > 0,
                "rings": wave(distance) > 0,
            }[name].float()
            background = torch.rand(3, 1, 1, generator=g)
            foreground = (background + 0.35 + 0.3 * torch.rand(3, 1, 1, generator=g)) % 1
            image = background + (foreground - background) * pattern + 0.08 * torch.randn(3, size, size, generator=g)
            pixels = (image.clamp(0, 1) * 255).to(torch.uint8).permute(1, 2, 0).numpy()
            Image.fromarray(pixels).save(folder / name / f"{i:04d}.jpg", quality=90)


# ------------------------------------------------------------------------------------------ the ResNet
def resnet(name, num_classes, weights=None, freeze=False):
    """A torchvision ResNet; `weights` (see load_weights) are loaded but a classifier head of another shape;
    freeze: only the head (fc) trains."""
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if weights:
        state = load_weights(name, weights)
        own = model.state_dict()
        skipped = {k for k in ("fc.weight", "fc.bias") if k in state and state[k].shape != own[k].shape}
        try:
            missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, False)
        except RuntimeError as error:
            raise UsageError(f"--weights {weights} do not fit {name}: {str(error).splitlines()[1].strip()}") from None
        if set(missing) - skipped or unexpected:
            raise UsageError(
                f"--weights {weights} do not fit {name}: {len(set(missing) - skipped)} missing and "
                f"{len(unexpected)} unexpected keys; pass weights saved from a {name}"
            )
    for param_name, param in model.named_parameters():
        param.requires_grad = not freeze or param_name.startswith("fc.")
    return model


def load_weights(name, weights):
    """--weights: a local file (a state dict or one of our checkpoints), or torchvision's name for the model's weights
    (DEFAULT, IMAGENET1K_V1, ...), downloaded once into the torch hub cache and read from there afterwards."""
    if Path(weights).exists() or not re.fullmatch(r"(\w+_Weights\.)?[A-Za-z]\w*", weights):
        state = guards.load_checked(weights, "--weights")
        return state.get("model", state)  # one of our checkpoints, or a bare state dict
    enum = torchvision.models.get_model_weights(name)
    family, _, short = weights.upper().rpartition(".")  # e.g. RESNET18_WEIGHTS, IMAGENET1K_V1
    if family and family != enum.__name__.upper():
        other = family.removesuffix("_WEIGHTS").lower()
        raise UsageError(
            f"--weights {weights} are for {other}, not {name}: add --model {other}, or give one of "
            f"{name}'s: {', '.join(enum.__members__)}"
        )
    if short not in enum.__members__:
        raise UsageError(
            f"--weights {weights}: no such file, and torchvision has no weights of that name for "
            f"{name}; it has {', '.join(enum.__members__)}"
        )
    # the file torch.hub.load_state_dict_from_url reads, or downloads to (a temporary file, renamed when complete)
    url = enum[short].url
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urllib.parse.urlparse(url).path)
    try:
        return enum[short].get_state_dict(map_location="cpu", weights_only=True, check_hash=True)
    except Exception as error:
        reason = str(error).strip().splitlines()[0].split(". ")[0][:120] if str(error).strip() else repr(error)
        if cached.exists():
            raise UsageError(
                f"--weights {weights}: {cached} is not readable ({reason}); delete it to download it again"
            ) from None
        raise UsageError(
            f"--weights {weights}: cannot download {url} ({reason}); on a machine without network, put that file "
            f"at {cached}"
        ) from None
