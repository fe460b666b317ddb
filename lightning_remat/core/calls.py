"""A module that runs several times in one step (a trunk under two heads): one place in the chain per run,
one option for all its places, which the chain DP cannot express. ``tied_dp`` runs over modules, carrying
per *round* (a run of places in module order) the bytes stored and the largest term so far; both only
grow, so a state over the budget is dropped at once. Exact up to ``MAX_TIED_FRONTIER`` states per module.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .memory_model import Profile, segment_peaks

MAX_TIED_FRONTIER = 4_000
_NONE = -(2**62)  # "no term yet": far below any figure, far from int64's least


def owners(profile: Profile) -> list[int]:
    """Per place, the index of its module's first place (the place itself for a first place)."""
    first: dict[str, int] = {}
    found = []
    for i, stage in enumerate(profile.stages):
        if not stage.call or stage.name not in first:
            first[stage.name] = i
        found.append(first[stage.name])
    return found


def check_tied(profile: Profile, choices: Sequence[int]) -> None:
    """Raise ValueError where two places of one module have different options."""
    for i, owner in enumerate(owners(profile)):
        if choices[i] != choices[owner]:
            raise ValueError(f"stage {profile.stages[i].name!r} runs several times per step: its places must "
                             f"share one option, got {choices[owner]} and {choices[i]}")


def _rounds(profile: Profile, owner: list[int]) -> tuple[list[int], np.ndarray]:
    """Per place, its round; and which rounds are alive under which (``[r', r]``: same episode, r' first)."""
    found, episodes, current, previous = [], [0], 0, -1
    for i, module in enumerate(owner):
        fresh = profile.stages[i].fresh and i > 0
        if module <= previous or fresh:
            current += 1
            episodes.append(episodes[-1] + fresh)
        found.append(current)
        previous = module
    count = current + 1
    under = np.array([[r < q and episodes[r] == episodes[q] for q in range(count)] for r in range(count)], dtype=float)
    return found, under


def _tables(profile: Profile, kind: str) -> tuple:
    """Per module (first places in order): its places, and per option (stored, local, cost) of each place."""
    owner = owners(profile)
    modules = sorted(set(owner))
    rows = []
    for m in modules:
        at = [i for i, o in enumerate(owner) if o == m]
        names = [tuple(o.name for o in profile.stages[i].options) for i in at]
        if any(n != names[0] for n in names):
            raise ValueError(f"stage {profile.stages[m].name!r}: its places offer different options {names}")
        options = [[(profile.stages[i].options[j].stored_bytes, profile.stages[i].options[j].local_peak_bytes,
                     profile.stages[i].options[j].costs[kind]) for i in at] for j in range(len(names[0]))]
        rows.append((at, options))
    return owner, rows


def _pareto_nd(points: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``points`` no other row is at or below in every column (one of equal rows)."""
    order = np.lexsort(points.T[::-1])
    ranked = points[order]
    kept_rows = np.empty((0, points.shape[1]))
    kept: list[np.ndarray] = []
    chunk = 256
    for start in range(0, len(ranked), chunk):
        block = ranked[start:start + chunk]
        # Sorted: only an earlier row can be at or below a row everywhere.
        below = np.tril((block[None, :, :] <= block[:, None, :]).all(-1), -1).any(-1)
        if len(kept_rows):
            below |= (kept_rows[None, :, :] <= block[:, None, :]).all(-1).any(-1)
        kept.append(order[start:start + chunk][~below])
        kept_rows = np.concatenate((kept_rows, block[~below]))
    return np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)


def _thinned(points: np.ndarray, value: np.ndarray) -> np.ndarray:
    """At most ``MAX_TIED_FRONTIER`` of the rows: the best by ``value`` and by each column, and a spread."""
    if len(points) <= MAX_TIED_FRONTIER:
        return np.arange(len(points))
    picks = {int(np.argmin(value))} | {int(np.argmin(points[:, d])) for d in range(points.shape[1])}
    by_value = np.argsort(value, kind="stable")
    picks.update(int(i) for i in by_value[:MAX_TIED_FRONTIER // 2])
    spread = np.linspace(0, len(points) - 1, MAX_TIED_FRONTIER - len(picks)).astype(np.int64)
    picks.update(int(i) for i in np.argsort(points.sum(axis=1), kind="stable")[spread])
    return np.array(sorted(picks), dtype=np.int64)


def _falls(rows: list, rounds: list[int], under: np.ndarray) -> np.ndarray:
    """Per module row, the most earlier rounds' stored bytes can still fall (sharded figures go below zero)."""
    r_count = len(under)
    falls = np.zeros((len(rows) + 1, r_count))
    for k in range(len(rows) - 1, -1, -1):
        at, options = rows[k]
        least = np.zeros(r_count)
        for option in options:
            delta = np.zeros(r_count)
            for i, (stored, _, _) in zip(at, option):
                delta[rounds[i]] += stored
            least = np.minimum(least, delta @ under)
        falls[k] = falls[k + 1] + least
    return falls


def _backtrack(back: list[tuple[np.ndarray, np.ndarray]], best: int, rows: list, owner: list[int]) -> list[int]:
    """The option per place of the state ``best`` of the last row, followed back through ``back``."""
    by_module = [0] * len(rows)
    for k in range(len(rows) - 1, -1, -1):
        parent, chosen = back[k]
        by_module[k] = int(chosen[best])
        best = int(parent[best])
    first = {at[0]: by_module[k] for k, (at, _) in enumerate(rows)}
    return [first[o] for o in owner]


def tied_dp(profile: Profile, budget: int | None, kind: str) -> list[int] | None:
    """Option index per place of the least-cost plan within ``budget`` (None: least peak); None if none fits."""
    owner, rows = _tables(profile, kind)
    rounds, under = _rounds(profile, owner)
    r_count = len(under)
    # The segments' peaks: with no place alive (a constant term), and after each place.
    peaks = segment_peaks(profile)
    constant, after = peaks.get(0, _NONE), {k - 1: peak for k, peak in peaks.items() if k}
    if budget is not None and constant > budget:
        return None
    falls = _falls(rows, rounds, under)
    stored = np.zeros((1, r_count))
    terms = np.full((1, r_count), float(_NONE))
    terms[0, 0] = constant
    cost = np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for k, (at, options) in enumerate(rows):
        new_stored, new_terms, new_cost, parent, chosen = [], [], [], [], []
        for j, option in enumerate(options):
            delta = np.zeros(r_count)
            term = np.full((len(stored), r_count), float(_NONE))
            for i, (s, local, _) in zip(at, option):
                r = rounds[i]
                delta[r] += s
                term[:, r] = stored[:, r] + local
                if i in after:
                    term[:, r] = np.maximum(term[:, r], stored[:, r] + s + after[i])
            grown = stored + delta
            earlier, shift = grown @ under, delta @ under
            new_terms.append(np.maximum(terms + shift, np.where(term > _NONE / 2, earlier + term, float(_NONE))))
            new_stored.append(grown)
            new_cost.append(cost + sum(c for _, _, c in option))
            parent.append(np.arange(len(stored)))
            chosen.append(np.full(len(stored), j))
        stored, terms, cost = np.concatenate(new_stored), np.concatenate(new_terms), np.concatenate(new_cost)
        parent, chosen = np.concatenate(parent), np.concatenate(chosen)
        if budget is not None:
            fits = (terms + falls[k + 1] <= budget).all(axis=1)
            stored, terms, cost, parent, chosen = stored[fits], terms[fits], cost[fits], parent[fits], chosen[fits]
            if not len(cost):
                return None
            # Round 0's terms are final once within the budget; the others grow with the earlier rounds.
            points = np.concatenate((stored, terms[:, 1:], cost[:, None]), axis=1)
            value = cost
        else:
            points = np.concatenate((stored, terms), axis=1)
            value = terms.max(axis=1)
        keep = _pareto_nd(points)
        keep = keep[_thinned(points[keep], value[keep])]
        stored, terms, cost = stored[keep], terms[keep], cost[keep]
        back.append((parent[keep], chosen[keep]))
    peak = terms.max(axis=1)
    best = int(np.lexsort((peak, cost))[0]) if budget is not None else int(np.lexsort((cost, peak))[0])
    return _backtrack(back, best, rows, owner)

