"""Global rank -> coordinates and group members, in megatron-core's rank order.

megatron-core (parallel_state.RankGenerator) numbers ranks with the first name of the
order varying fastest. With the default order "tp-cp-ep-dp-pp" it builds two views of
the same world with the same pp groups:
  attention: tp-cp-dp-pp   (ep dropped)
  experts:   etp-ep-edp-pp (cp dropped; its tp slot is etp and its dp slot is edp)
so in the attention view rank = t + TP*(c + CP*(d + DP*p)) for coordinates t, c, d, p and
sizes TP, CP, DP, and likewise for experts.
"""

from dataclasses import dataclass
from functools import cached_property

from parallel.plan import ParallelPlan, PlanError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
GROUP_NAMES = ("tp", "cp", "dp", "pp", "ep", "etp", "edp")
# which view a group lives in, and its token in the order string
_VIEW_OF = {
    "tp": "attention",
    "cp": "attention",
    "dp": "attention",
    "pp": "attention",
    "ep": "expert",
    "etp": "expert",
    "edp": "expert",
}
_TOKEN_OF = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "ep": "ep", "etp": "tp", "edp": "dp"}


@dataclass(frozen=True)
class RankCoords:
    rank: int
    node: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int


def _strides(sizes: list[int]) -> list[int]:
    strides, acc = [], 1
    for size in sizes:
        strides.append(acc)
        acc *= size
    return strides


@dataclass(frozen=True)
class _View:
    """One orthogonal numbering of the world: names in order (fastest first) and sizes."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def coord(self, rank: int, name: str) -> int:
        i = self.names.index(name)
        return (rank // _strides(list(self.sizes))[i]) % self.sizes[i]

    def group(self, rank: int, name: str) -> tuple[int, ...]:
        i = self.names.index(name)
        stride = _strides(list(self.sizes))[i]
        base = rank - self.coord(rank, name) * stride
        return tuple(base + k * stride for k in range(self.sizes[i]))


@dataclass(frozen=True)
class RankLayout:
    plan: ParallelPlan
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        tokens = self.order.split("-")
        if sorted(tokens) != sorted(("tp", "cp", "ep", "dp", "pp")):
            raise PlanError(
                f"order={self.order!r} must name tp, cp, ep, dp, pp once each, e.g. {DEFAULT_ORDER}"
            )
        pp_attention = self.groups("pp")
        pp_expert = {self._views["expert"].group(r, "pp") for r in range(self.plan.world)}
        if set(pp_attention) != pp_expert:
            raise PlanError(
                f"order={self.order!r} gives attention and expert layers different "
                f"pp groups: put pp last ({DEFAULT_ORDER}) or make edp equal dp"
            )

    @cached_property
    def _views(self) -> dict[str, _View]:
        plan, tokens = self.plan, self.order.split("-")
        attention = {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp}
        expert = {"tp": plan.etp, "ep": plan.ep, "dp": plan.edp, "pp": plan.pp}
        return {
            view: _View(
                tuple(t for t in tokens if t in sizes),
                tuple(sizes[t] for t in tokens if t in sizes),
            )
            for view, sizes in (("attention", attention), ("expert", expert))
        }

    def node_of(self, rank: int) -> int:
        return rank // self.plan.devices_per_node

    def coords(self, rank: int) -> RankCoords:
        self._check_rank(rank)
        values = {
            name: self._views[_VIEW_OF[name]].coord(rank, _TOKEN_OF[name]) for name in GROUP_NAMES
        }
        return RankCoords(rank=rank, node=self.node_of(rank), **values)

    def group(self, rank: int, name: str) -> tuple[int, ...]:
        """Members (global ranks, ascending) of `rank`'s group of kind `name`."""
        self._check_rank(rank)
        if name not in GROUP_NAMES:
            raise KeyError(f"unknown group {name!r}: choose one of {', '.join(GROUP_NAMES)}")
        return self._views[_VIEW_OF[name]].group(rank, _TOKEN_OF[name])

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """All groups of kind `name`, ordered by their lowest rank."""
        return sorted({self.group(r, name) for r in range(self.plan.world)})

    def nodes_spanned(self, name: str) -> int:
        """Most nodes any one group of kind `name` spans (1 = stays inside a node)."""
        return max(len({self.node_of(r) for r in g}) for g in self.groups(name))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.plan.world:
            raise IndexError(f"rank {rank} outside world of {self.plan.world}")
