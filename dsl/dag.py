"""Small graph algorithms over `name -> names it depends on` maps, for step lowering (`dsl.steps`)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def topological(deps: Mapping[str, Sequence[str]], key: Mapping[str, tuple[int, int]]) -> list[str]:
    """Kahn's algorithm; among the names ready at once, the smallest `key` first (statement order)."""
    waiting = {n: len(set(d)) for n, d in deps.items()}
    users: dict[str, list[str]] = {n: [] for n in deps}
    for n, ds in deps.items():
        for d in set(ds):
            users[d].append(n)
    ready = [(key[n], n) for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (key[u], u))
    return out


def strongly_connected(deps: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (bodies are small, but recursion limits are not worth the risk)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in deps:
        if root in index:
            continue
        work = [(root, iter(deps[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(deps[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    scc.append(top)
                    if top == node:
                        break
                out.append(scc)
    return out


def cycle_through(start: str, deps: Mapping[str, Sequence[str]], members: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside one strongly connected component."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for n in frontier:
            for d in deps[n]:
                if d not in members:
                    continue
                if d == start:
                    path = [n]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if n != start else [start, start]
                if d not in parents:
                    parents[d] = n
                    nxt.append(d)
        frontier = nxt
    return [start, start]
