"""The weights of a module saved and restored as verl's decoupled PPO asks, with one host copy
at most (recipes.dapo.engine.decoupled calls it from verl's actor worker).

verl's FSDP / Megatron helpers keep two host copies during a sync cycle's later steps: the
cycle's first weights (pi_old) and the current ones. Here saving the current weights is
deferred, and restoring pi_old swaps it with the live weights tensor by tensor, so the copy
then holds the current weights until they are swapped back. verl 0.9.1's order, per cycle:
save(0) at its first step; save(k), restore(0), the old-log-prob pass, restore(k), clear(k)
at step k.
"""

import torch


class HostSnapshots:
    """verl's save / restore / clear of a module's parameters, with one host copy at most."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for _, p in sorted(module.named_parameters())]
        self.copy: list[torch.Tensor] | None = None  # holds the weights labelled `self.held`
        self.held: int | None = None
        self.live: int | None = None  # the label the live weights carry (set by save)

    def touches_weights(self, op: str, n: int) -> bool:
        """Whether `op`(n) reads or writes the parameters (a caller that offloads them loads
        them first only then)."""
        if op == "save":
            return self._copies(n)
        return op == "restore" and self.live != n

    def _copies(self, n: int) -> bool:
        return self.copy is None or n == 0 or self.held is None

    def save(self, n: int) -> None:
        """Remember the live weights as `n`: copied if nothing is held yet or n is 0 (a
        cycle's pi_old); otherwise only labelled (restore swaps them out when needed)."""
        if self._copies(n):
            with torch.no_grad():
                if self.copy is None:
                    self.copy = [p.detach().to("cpu", copy=True) for p in self.params]
                else:
                    for saved, p in zip(self.copy, self.params, strict=True):
                        saved.copy_(p.detach())
            self.held, self.live = n, n
            return
        self.live = n

    def restore(self, n: int) -> None:
        """Make the live weights `n`'s: swap with the copy when it holds `n`."""
        if self.live == n:
            return
        if self.held != n:
            raise KeyError(f"no saved weights {n} (held: {self.held}, live: {self.live})")
        with torch.no_grad():
            for saved, p in zip(self.copy, self.params, strict=True):
                live = p.detach().to("cpu", copy=True)
                p.copy_(saved)
                saved.copy_(live)
        self.held, self.live = self.live, n

    def clear(self, n: int) -> None:
        """Forget `n` (the copy stays allocated for the next cycle's pi_old)."""
        if self.live == n:
            self.live = None
        if self.held == n:
            self.held = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copy or [])
