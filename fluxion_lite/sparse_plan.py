"""Which KV groups attend sparsely, and how: the per-(layer, KV group) plan the sparse backend executes."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ModelFileError

GRANULARITIES = (16, 32, 64, 128)
MAX_PIN_SPAN = 8  # a span of pinned blocks longer than this would be a dense region, not a needle's value


@dataclass(frozen=True)
class GroupPlan:
    streaming: bool  # True: sink + recent window only
    g: int = 16  # block size for top-k selection (retrieval groups)
    budget: float = 0.0  # fraction of the context selected by top-k, on top of sink + window


@dataclass
class SparsePlan:
    sink: int  # first tokens always attended
    window: int  # most recent tokens always attended
    groups: list[list[GroupPlan]]  # [layer][kv_group]
    source: str = ""  # how the plan was made (for --explain and logs)
    # share of each retrieval group's block budget pinned at the end of prefill by the attention of the prompt's last
    # obs_window tokens (pinned.py); 0 = every block chosen by the per-step top-k
    pin_fraction: float = 0.0
    obs_window: int = 32
    scoring: str = "group"  # block scoring of the native top-k: "group" or "per-head" (native.SCORINGS)
    # pins come in spans: a block also scores by its pin_span - 1 predecessors' mass, x pin_decay per block back, so
    # a heavy block's successors (the value after a needle's key) are pinned too, within the same pin count;
    # pin_span 1 = the heaviest blocks alone (pinned.pick_pins)
    pin_span: int = 1
    pin_decay: float = 1.0

    @classmethod
    def uniform(cls, n_layers: int, n_groups: int, g: int, budget: float, sink: int, window: int) -> "SparsePlan":
        groups = [[GroupPlan(False, g, budget) for _ in range(n_groups)] for _ in range(n_layers)]
        return cls(sink, window, groups, source=f"uniform g={g} budget={budget}")

    def validate(self, n_layers: int, n_groups: int) -> None:
        if len(self.groups) != n_layers or any(len(row) != n_groups for row in self.groups):
            raise ModelFileError(f"sparse plan has shape {len(self.groups)}x? but the model has {n_layers}x{n_groups}")
        for row in self.groups:
            for gp in row:
                if not gp.streaming and (gp.g not in GRANULARITIES or not 0.0 < gp.budget <= 1.0):
                    raise ModelFileError(f"sparse plan: bad group entry {gp}")
        if self.scoring not in ("group", "per-head"):
            raise ModelFileError(f"sparse plan: scoring must be 'group' or 'per-head' (got {self.scoring!r})")
        if not 0.0 <= self.pin_fraction <= 1.0 or self.obs_window < 1:
            raise ModelFileError(f"sparse plan: pin_fraction must be in [0, 1] and obs_window >= 1 "
                                 f"(got {self.pin_fraction}, {self.obs_window})")
        if not 1 <= self.pin_span <= MAX_PIN_SPAN:
            raise ModelFileError(f"sparse plan: pin_span must be in [1, {MAX_PIN_SPAN}] (got {self.pin_span})")
        if not 0.0 < self.pin_decay <= 1.0:
            raise ModelFileError(f"sparse plan: pin_decay must be in (0, 1] (got {self.pin_decay})")

    def save(self, path: Path) -> None:
        data = {"sink": self.sink, "window": self.window, "source": self.source,
                "groups": [[asdict(gp) for gp in row] for row in self.groups]}
        if self.pin_fraction:
            data |= {"pin_fraction": self.pin_fraction, "obs_window": self.obs_window}
        if self.scoring != "group":
            data["scoring"] = self.scoring
        if self.pin_span != 1:
            data["pin_span"] = self.pin_span
        if self.pin_decay != 1.0:
            data["pin_decay"] = self.pin_decay
        path.write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: Path) -> "SparsePlan":
        try:
            data = json.loads(Path(path).read_text())
            groups = [[GroupPlan(**gp) for gp in row] for row in data["groups"]]
            pin_span = data.get("pin_span", 1)
            if type(pin_span) is not int:  # 2.5 or "2" would otherwise be truncated or parsed silently
                raise ValueError(f"pin_span must be an integer (got {pin_span!r})")
            return cls(int(data["sink"]), int(data["window"]), groups, str(data.get("source", path.name)),
                       float(data.get("pin_fraction", 0.0)), int(data.get("obs_window", 32)),
                       str(data.get("scoring", "group")), pin_span,
                       float(data.get("pin_decay", 1.0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(f"{path}: unreadable sparse plan ({exc})") from exc

    def explain(self) -> str:
        lines = [f"sparse plan ({self.source}): sink {self.sink}, window {self.window}"]
        if self.scoring != "group":
            lines.append(f"  blocks scored per query head ({self.scoring})")
        if self.pin_fraction:
            lines.append(f"  {self.pin_fraction:.0%} of each retrieval budget pinned at prefill end "
                         f"(attention of the last {self.obs_window} prompt tokens"
                         + (f", spans of {self.pin_span} blocks, successors x{self.pin_decay:g})"
                            if self.pin_span != 1 else ")"))
        for i, row in enumerate(self.groups):
            ret = [gp for gp in row if not gp.streaming]
            desc = ", ".join(f"g={gp.g} b={gp.budget:.3f}" for gp in ret) or "-"
            lines.append(f"  layer {i:>2}: {len(row) - len(ret)} streaming, {len(ret)} retrieval [{desc}]")
        return "\n".join(lines)

    @property
    def streaming_fraction(self) -> float:
        flat = [gp for row in self.groups for gp in row]
        return sum(gp.streaming for gp in flat) / max(1, len(flat))
