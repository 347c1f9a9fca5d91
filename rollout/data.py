"""Prompt data: records ``{"prompt", "label", "metadata"}`` served in seeded epochs.

The data position is one integer, the number of prompts handed out so far. The order of epoch
``e`` is a permutation seeded by ``(seed, e)``, so any position can be resumed exactly from that
integer alone (which the lake records per iteration).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PromptDataset:
    records: list[dict]
    seed: int = 0
    shuffle: bool = True
    source: str = "builtin"

    def __post_init__(self) -> None:
        if not self.records:
            raise ValueError(f"prompt data '{self.source}' is empty")
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def take(self, position: int, count: int) -> list[tuple[int, dict]]:
        """``count`` records starting at global ``position``: [(row index, record)]."""
        out = []
        for pos in range(position, position + count):
            epoch, offset = divmod(pos, len(self.records))
            row = self._order(epoch)[offset]
            out.append((row, self.records[row]))
        return out
