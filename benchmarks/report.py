"""Writing a scenario's results: ``report.md``, ``results.json`` and PNG plots (Agg backend).

Every report opens with the machine and the exact command, so a figure can always be traced back
to where and how it was measured. Benchmarks report ratios measured side by side in one run; the
absolute times are there to read, not to compare across machines.
"""

import datetime
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from replicas.model.autotune import cpu_facts


def machine_info() -> dict[str, object]:
    """Where the numbers come from: CPU (model, flags, what torch dispatches to), threads,
    library versions and the date."""
    cpu = cpu_facts()
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu["model"],
        "cpu_flags": cpu["flags"],
        "torch_cpu_capability": cpu["torch_capability"],
        "isa_limits": cpu["isa_limits"] or "none",
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def fmt(value: object) -> str:
    """A table cell: floats with 3 significant digits, booleans as pass/FAIL."""
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(slots=True)
class Report:
    """One scenario's report. ``sections`` are markdown blocks written in order after the
    header; ``results`` goes to ``results.json`` together with the machine and command."""

    scenario: str
    title: str
    command: str
    quick: bool
    summary: str
    sections: list[str] = field(default_factory=list)
    results: dict[str, object] = field(default_factory=dict)
    figures: dict[str, Figure] = field(default_factory=dict)  # file name -> figure

    def add_table(
        self, caption: str, headers: Sequence[str], rows: Sequence[Sequence[object]]
    ) -> None:
        table = markdown_table(headers, rows)
        self.sections.append(f"### {caption}\n\n{table}")
        print(f"\n{caption}\n{table}")

    def write(self, output_dir: Path) -> dict[str, object]:
        """Write report.md, results.json and the figures; return the JSON document."""
        output_dir.mkdir(parents=True, exist_ok=True)
        machine = machine_info()
        document = {
            "scenario": self.scenario,
            "command": self.command,
            "quick": self.quick,
            "machine": machine,
            **self.results,
        }
        (output_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
        for name, figure in self.figures.items():
            figure.savefig(output_dir / name, dpi=110, bbox_inches="tight")
        machine_rows = [[key, str(value)] for key, value in machine.items()]
        parts = [
            f"# {self.title}",
            self.summary,
            f"Command: `{self.command}`" + (" (quick sizes: smoke test, not figures)" * self.quick),
            "### Machine\n\n" + markdown_table(["", ""], machine_rows),
            *self.sections,
            *(f"![{name}]({name})" for name in self.figures),
        ]
        (output_dir / "report.md").write_text("\n\n".join(parts) + "\n")
        print(f"\nwrote {output_dir / 'report.md'}")
        return document


def new_figure(num_plots: int = 1, width: float = 6.0) -> tuple[Figure, list]:
    """A figure with ``num_plots`` side-by-side axes, drawn by the Agg backend (no display and
    no pyplot global state)."""
    figure = Figure(figsize=(width * num_plots, 4.0))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, num_plots, squeeze=False)
    return figure, list(axes[0])
