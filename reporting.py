# SPDX-License-Identifier: BSD-3-Clause
"""What a run shows beyond its progress lines: the confusion matrix as a picture (TensorBoard's val/confusion),
and --profile's profiler with its report. utils.Logger draws with it; the scripts start the profiler."""

import resource
import threading

import numpy
import torch


def is_image(value):
    return torch.is_tensor(value) and value.dim() == 3 and value.shape[0] in (1, 3)


def quiet_tensorboard_thread(hook):
    """threading.excepthook: TensorBoard's writer thread re-raises its I/O error, and Logger.writing() says it in one
    line from the main thread: the thread's own traceback would only repeat it. Any other thread's as usual."""
    if not (isinstance(hook.exc_value, OSError) and type(hook.thread).__module__.startswith("tensorboard")):
        threading.__excepthook__(hook)


def confusion_image(confusion, classes):
    """val/confusion, (3, H, W) uint8: rows true classes, columns predicted, shares white to blue (square root: small
    ones show); up to 30 classes named with each cell's %; the weakest listed beside (docs/data.md)."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(confusion)
    counts = confusion.sum(dim=1).tolist()  # validation images per true class
    font = ImageFont.load_default(size=12)
    rows = confusion.double() / confusion.sum(dim=1, keepdim=True).clamp(min=1)  # each row's shares
    # each class's name (its first 24 characters) and its count of images
    labels = [f"{str(name)[:24]}{'…' * (len(str(name)) > 24)} ({count})" for name, count in zip(classes, counts)]
    blue = torch.tensor([247, 207, 148])  # 255 - (8, 48, 107): white to dark blue

    def paint(share):
        """An RGB image of shares (0 to 1): white to dark blue, by the square root."""
        return Image.fromarray((255 - share.sqrt()[..., None] * blue).byte().numpy())

    if n <= 30:  # cells that hold their %, the names beside the grid
        cell = 34
        side = 12 + int(max(map(font.getlength, labels)))
    else:  # the grid alone, about 600 pixels wide (a pixel a cell past 600 classes)
        cell = 600 // n or 1
        side = 10
    weak = [i for i in rows.diagonal().argsort().tolist() if counts[i] and rows[i, i] < 1][:20]  # with mistakes
    other = (rows[weak] - 2 * torch.eye(n)[weak]).argmax(1).tolist()  # each one's most frequent wrong prediction
    notes = (
        ["weakest classes: accuracy; most often taken for" if weak else "no validation image mistaken"]
        + [f"{rows[i, i]:.0%}  {labels[i]}: {labels[j]} {rows[i, j]:.0%}" for i, j in zip(weak, other)]
        + ["", "rows: true class (validation images), columns: predicted; % of each row"]
    )
    grid = n * cell
    canvas = Image.new(
        "RGB",
        (side + grid + 80 + int(max(map(font.getlength, notes))), side + max(grid, 22 * len(notes) + 20) + 10),
        "white",
    )
    canvas.paste(paint(rows).resize((grid, grid), Image.NEAREST), (side, side))
    canvas.paste(paint(torch.linspace(1, 0, grid)[:, None].expand(grid, 14)), (side + grid + 10, side))  # the scale
    draw = ImageDraw.Draw(canvas)
    strip = Image.new("RGB", (side, grid), "white")  # the names, pasted along both axes
    for share in (0, 0.05, 0.25, 0.5, 1):
        draw.text((side + grid + 28, side + (1 - share**0.5) * grid), f"{share:.0%}", "black", font, anchor="lm")
    if n <= 30:
        for i, j in confusion.nonzero().tolist():
            draw.text(
                (side + (j + 0.5) * cell, side + (i + 0.5) * cell),
                f"{100 * rows[i, j]:.0f}",
                "white" if rows[i, j] > 0.3 else "black",
                font,
                anchor="mm",
            )
        for i in range(n):
            ImageDraw.Draw(strip).text((6, (i + 0.5) * cell), labels[i], "black", font, anchor="lm")
    canvas.paste(strip, (0, side))
    canvas.paste(strip.rotate(90, expand=True), (side, 0))
    draw.multiline_text((side + grid + 70, side), "\n".join(notes), "black", font, spacing=8)
    return torch.from_numpy(numpy.array(canvas)).permute(2, 0, 1)


class Profiler:
    """--profile N: torch.profiler over N steps after 3 warm-up steps: trace.json (https://ui.perfetto.dev), the top
    operators, the peak memory (tools/profile_report.py: where the step time went, the collectives per step)."""

    def __init__(self, output_dir, steps, enabled=True):
        self.output_dir = output_dir
        self.profile = None
        if steps and enabled:  # (the accelerator's activity too: torch's default)
            schedule = torch.profiler.schedule(wait=0, warmup=3, active=steps, repeat=1)
            self.profile = torch.profiler.profile(schedule=schedule, on_trace_ready=self.report, profile_memory=True)
            self.profile.start()

    def step(self):
        if self.profile:
            self.profile.step()

    def close(self):
        if self.profile:
            self.profile.stop()

    def report(self, profile):
        trace = self.output_dir / "trace.json"
        cuda = torch.cuda.is_available()
        profile.export_chrome_trace(str(trace))
        print(
            profile.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=8)
        )
        peak = (
            f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB on the GPU"
            if cuda
            else f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident"
        )
        print(
            f"profile: peak memory {peak}; trace in {trace}; where the step time went, and the collectives per "
            f"step: python tools/profile_report.py {trace}",
            flush=True,
        )
