"""``IntermediateTensors``: the named tensors one pipeline stage hands the next."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class IntermediateTensors(Mapping[str, torch.Tensor]):
    """Named per-token tensors (``hidden_states``, ``residual``, ...), first dim = tokens.

    Immutable mapping; ``it[a:b]`` slices every tensor by token range (a view), so a runner can
    hand a padded persistent buffer's first ``num_tokens`` rows to the model without copying.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors)

    def __getitem__(self, key: str | slice) -> torch.Tensor:  # type: ignore[override]
        if isinstance(key, slice):
            return IntermediateTensors({k: v[key] for k, v in self.tensors.items()})  # type: ignore[return-value]
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def copy_from(self, other: Mapping[str, torch.Tensor], num_tokens: int) -> None:
        """Copy ``other``'s first ``num_tokens`` rows into these (persistent) buffers, in place."""
        if set(other) != set(self.tensors):
            raise ValueError(
                f"intermediate tensor keys differ: expected {sorted(self.tensors)}, "
                f"got {sorted(other)}"
            )
        for k, buf in self.tensors.items():
            buf[:num_tokens].copy_(other[k][:num_tokens])

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={tuple(v.shape)}:{v.dtype}" for k, v in self.tensors.items())
        return f"IntermediateTensors({body})"
