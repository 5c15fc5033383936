"""How the engine checks models: one settings object, pure Python (the plugin builds it from its
options without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.vocabulary import Target

DIM_MODES = ("roles", "observed")


@dataclass(frozen=True)
class CheckSettings:
    """Session-wide settings of the check (per-model marker options override tolerances/examples).

    ``targets``: ``onnx`` exports to ONNX and runs onnxruntime, ``executorch`` lowers to an
    ExecuTorch program and runs ExecuTorch's runtime (each target a result of its own), ``torch``
    stops after torch.export;
    ``dims`` ``roles`` makes dynamic the dims whose role demands it (batch, sequence, cache and
    encoder lengths) besides the ones the tests vary, ``observed`` only the latter; ``static``
    names axes (``input:axis``) kept static in every model that takes that input (a marker's
    ``static=`` adds to them, its ``dynamic=`` takes them back for its model);
    ``patches`` are dotted paths to context-manager factories entered around export and
    verification; ``use_cache`` reads and writes the export cache under ``export_dir`` (under
    ``cache_root`` when given: checks made during the tests write their files elsewhere);
    ``timeout`` limits each model's check to that many seconds (``None``: no limit);
    ``every_graph`` checks the graphs of a model past its first failing one, whose failure is the
    model's verdict (``False``: the check ends there).
    """

    export_dir: Path
    targets: tuple[Target, ...] = (Target.ONNX,)
    atol: float | None = None
    rtol: float | None = None
    examples: int = 10
    patches: tuple[str, ...] = ()
    hypothesis_seed: int | None = None
    use_cache: bool = True
    dims: str = "roles"
    static: tuple[str, ...] = ()
    timeout: float | None = None
    cache_root: Path | None = None
    every_graph: bool = False

    @property
    def cache_dir(self) -> Path:
        """The export cache's directory (``cache`` is no model's: see :mod:`..core.paths`)."""
        return self.cache_root or self.export_dir / "cache"

    @property
    def hypothesis_dir(self) -> Path:
        """hypothesis' own storage (the constants it reads from the local modules' sources),
        one for the session: not each graph's directory."""
        return self.cache_dir / "hypothesis"
