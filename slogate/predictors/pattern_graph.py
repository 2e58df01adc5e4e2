"""Pattern graphs of compound (agent) requests and stage sub-deadlines from history (JITServe §4.1).

A workflow's calls become a networkx DiGraph — LLM nodes (input/output tokens, label = the
model / phase / kind of the call), tool-or-gap nodes (duration) in front of the calls they
delay, dependency edges carrying the child's input tokens — summarised per stage into
super-nodes (calls, input and output tokens, non-LLM time, estimated stage time).

Matching a workflow in progress (stages < s revealed, stage s being issued) against a store
of finished ones:
1. prune histories with fewer stages, or whose stage labels diverge on the revealed prefix
   (a different model / tool / phase at some stage); relax the label test if nothing is left;
2. similarity = mean over the prefix's super-nodes of a Gaussian kernel on *normalised*
   attributes (log-scaled, divided by the store's spread, width `sigma`) — only the prefix is
   compared (graphs of different lengths match on what both have);
3. φ̂(s) = kernel-weighted mean of the matches' φ(s) = t_≤s / t_total; the remaining stage
   count likewise. D_s = φ̂(s)·D is the stage's sub-deadline.
The store keeps at most `capacity` graphs, evicting the least reused (reuse counts decay by
0.9 per hour), and can be compacted to k medoids. `JITServeCodeMatcher` reproduces the
published code's approach for comparison: raw token attributes, kernel width 1 token, whole
graphs compared position by position with no prefix matching, best single match.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import networkx as nx
import numpy as np

TOKEN_TIME_S = 0.025  # decode time per output token in the stage-time model
PREFILL_S_PER_TOKEN = 1e-4
N_ATTR = 4  # per stage: log calls, log input tokens, log output tokens, log non-LLM seconds
KNOWN_AT_ISSUE = np.array([True, True, False, True])  # the issued stage's output is not known yet


class CallLike(Protocol):
    call_id: int
    stage: int
    input_tokens: int
    output_tokens: int
    parents: list[int]
    gap_s: float
    label: str


@dataclass(slots=True)
class WfCall:
    call_id: int
    stage: int
    input_tokens: int
    output_tokens: int
    parents: list[int]
    gap_s: float = 0.0
    label: str = ""


def call_label(c: dict, by_id: dict[int, dict]) -> str:
    """What the call is, known when it is issued: its phase/kind/model, or for ReAct the tool
    whose result it reads (the tool its parent chose)."""
    for k in ("phase", "kind"):
        if c.get(k):
            return str(c[k])
    if "tool" in c:
        parents = c.get("parent_ids") or []
        return str(by_id[parents[-1]].get("tool") or "none") if parents and parents[-1] in by_id else "start"
    return str(c.get("model") or "llm")


def load_workflow_calls(path: str | Path) -> list[tuple[str, list[WfCall]]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            w = json.loads(line)
            by_id = {int(c["call_id"]): c for c in w["calls"]}
            calls = [WfCall(int(c["call_id"]), int(c["stage"]), max(int(c["input_tokens"]), 1), max(int(c["output_tokens"]), 1),
                            [int(p) for p in c.get("parent_ids") or []], float(c.get("gap_before_s") or c.get("tool_time_s") or 0.0),
                            call_label(c, by_id)) for c in w["calls"]]
            out.append((str(w["workflow_id"]), calls))
    return out


def call_time(c: CallLike) -> float:
    return c.gap_s + c.input_tokens * PREFILL_S_PER_TOKEN + c.output_tokens * TOKEN_TIME_S


def workflow_graph(calls: Iterable[CallLike]) -> nx.DiGraph:
    """LLM nodes, tool/gap nodes before the calls they delay, dependency edges."""
    g = nx.DiGraph()
    for c in calls:
        g.add_node(c.call_id, kind="llm", stage=c.stage, input=c.input_tokens, output=c.output_tokens, label=c.label)
        src = [("gap", c.call_id)] if c.gap_s > 0 else []
        if src:
            g.add_node(src[0], kind="tool", stage=c.stage, duration=c.gap_s)
            g.add_edge(src[0], c.call_id, input=c.input_tokens)
        for p in c.parents:
            g.add_edge(p, src[0] if src else c.call_id, input=c.input_tokens)
    return g


@dataclass(slots=True)
class StageNode:
    """A stage super-node."""

    stage: int
    label: str
    calls: int
    input_tokens: int
    output_tokens: int
    tool_s: float
    time_s: float  # calls of a stage run side by side: the slowest one

    def vector(self) -> np.ndarray:
        return np.array([math.log1p(self.calls), math.log1p(self.input_tokens), math.log1p(self.output_tokens), math.log1p(self.tool_s)])


def stage_summary(g: nx.DiGraph) -> list[StageNode]:
    per: dict[int, dict] = {}
    for n, d in g.nodes(data=True):
        if d["kind"] != "llm":
            continue
        s = per.setdefault(d["stage"], {"labels": set(), "calls": 0, "in": 0, "out": 0, "tool": 0.0, "time": 0.0})
        gap = sum(g.nodes[p]["duration"] for p in g.predecessors(n) if g.nodes[p]["kind"] == "tool")
        s["labels"].add(d["label"])
        s["calls"] += 1
        s["in"] += d["input"]
        s["out"] += d["output"]
        s["tool"] = max(s["tool"], gap)
        s["time"] = max(s["time"], gap + d["input"] * PREFILL_S_PER_TOKEN + d["output"] * TOKEN_TIME_S)
    return [StageNode(k, "+".join(sorted(v["labels"])), v["calls"], v["in"], v["out"], v["tool"], v["time"]) for k, v in sorted(per.items())]


def stage_shares(stages: Sequence[StageNode]) -> np.ndarray:
    """φ(s) for every stage: cumulative share of the workflow's time through stage s."""
    t = np.array([s.time_s for s in stages], dtype=float)
    total = t.sum()
    return np.cumsum(t) / total if total > 0 else np.linspace(1 / max(len(t), 1), 1, len(t))


# ------------------------------------------------------------------ the store and the matcher
@dataclass
class Pattern:
    key: str
    stages: list[StageNode]
    phi: np.ndarray
    reuse: float = 0.0
    reuse_at: float = 0.0  # hours
    weight: float = 1.0  # how many histories it stands for after compaction


@dataclass
class Estimate:
    phi: float  # φ̂(s)
    share: float  # estimated share of stage s alone
    stages_left: float  # estimated stages after s
    matched: int  # candidates that survived pruning


@dataclass
class PatternStore:
    sigma: float = 0.5  # kernel width in units of the store's attribute spread
    capacity: int = 500
    decay_per_hour: float = 0.9
    top_k: int = 20
    patterns: list[Pattern] = field(default_factory=list)
    _labels: dict[str, int] = field(default_factory=dict)
    _dirty: bool = True

    def add(self, key: str, calls: Iterable[CallLike], now_h: float = 0.0) -> None:
        st = stage_summary(workflow_graph(calls))
        if not st:
            return
        if len(self.patterns) >= self.capacity:
            self._evict(now_h)
        self.patterns.append(Pattern(key, st, stage_shares(st), 0.0, now_h))
        self._dirty = True

    def _score(self, p: Pattern, now_h: float) -> float:
        return p.reuse * self.decay_per_hour ** max(now_h - p.reuse_at, 0.0)

    def _evict(self, now_h: float) -> None:
        i = min(range(len(self.patterns)), key=lambda j: (self._score(self.patterns[j], now_h), self.patterns[j].reuse_at))
        self.patterns.pop(i)
        self._dirty = True

    def _compile(self) -> None:
        """Pad every pattern's stage vectors into one array for vectorised matching."""
        n = len(self.patterns)
        L = max((len(p.stages) for p in self.patterns), default=1)
        self.A = np.zeros((n, L, N_ATTR))
        self.lab = np.full((n, L), -1, dtype=np.int64)
        self.len = np.zeros(n, dtype=np.int64)
        self.PHI = np.ones((n, L))
        self.W = np.array([p.weight for p in self.patterns])
        for i, p in enumerate(self.patterns):
            k = len(p.stages)
            self.A[i, :k] = np.vstack([s.vector() for s in p.stages])
            self.lab[i, :k] = [self._labels.setdefault(s.label, len(self._labels)) for s in p.stages]
            self.len[i] = k
            self.PHI[i, :k] = p.phi
        valid = self.lab >= 0
        self.scale = self.A[valid].std(axis=0) + 1e-6 if valid.any() else np.ones(N_ATTR)
        self.keys = [p.key for p in self.patterns]
        self._dirty = False

    def match(self, revealed: Sequence[StageNode], current: StageNode, exclude: str | None = None, now_h: float = 0.0) -> Estimate | None:
        """Estimate φ(s) for stage s = len(revealed), with `current` holding what is known of it
        at issue (label, calls, input tokens; its output is unknown)."""
        if not self.patterns:
            return None
        if self._dirty:
            self._compile()
        s = len(revealed)
        if s >= self.A.shape[1]:
            return None  # longer than every stored graph
        cand = self.len > s
        if exclude is not None:
            cand &= np.array([k != exclude for k in self.keys])
        x = np.vstack([*(r.vector() for r in revealed), current.vector()])  # (s+1, N_ATTR)
        labs = np.array([self._labels.get(r.label, -2) for r in [*revealed, current]])
        same = (self.lab[:, : s + 1] == labs).all(axis=1) & cand
        use = same if same.any() else cand
        idx = np.flatnonzero(use)
        if idx.size == 0:
            return None
        d = (self.A[idx, : s + 1] - x) / self.scale  # normalised differences on the shared prefix
        d[:, s, ~KNOWN_AT_ISSUE] = 0.0
        sim = np.exp(-(d**2).sum(axis=2) / (2 * self.sigma**2)).mean(axis=1) * self.W[idx]
        top = np.argsort(-sim)[: self.top_k]
        w = sim[top]
        if w.sum() <= 1e-12:
            w = np.ones_like(w)
        w = w / w.sum()
        rows = idx[top]
        phi_s = self.PHI[rows, s]
        phi_prev = self.PHI[rows, s - 1] if s > 0 else np.zeros(len(rows))
        for r in rows[w >= w.max() * 0.5]:
            p = self.patterns[r]
            p.reuse = self._score(p, now_h) + 1.0
            p.reuse_at = now_h
        return Estimate(float(w @ phi_s), float(w @ (phi_s - phi_prev)), float(w @ (self.len[rows] - s - 1)), int(idx.size))

    # -------------------------------------------------------------- compaction
    def distance_matrix(self) -> np.ndarray:
        """Mean normalised stage distance over the shorter prefix, plus a length-mismatch term."""
        if self._dirty:
            self._compile()
        n = len(self.patterns)
        D = np.zeros((n, n))
        for i in range(n):
            L = np.minimum(self.len, self.len[i])
            diff = (self.A - self.A[i]) / self.scale
            dist = np.sqrt((diff**2).sum(axis=2))
            mask = np.arange(self.A.shape[1])[None, :] < L[:, None]
            D[i] = (dist * mask).sum(axis=1) / np.maximum(L, 1) + np.abs(np.log1p(self.len) - np.log1p(self.len[i]))
        return D

    def compact(self, k: int, seed: int = 0, iters: int = 20) -> None:
        """Replace the store by k medoids (alternating k-medoids), each weighted by its cluster size."""
        n = len(self.patterns)
        if n <= k:
            return
        D = self.distance_matrix()
        rng = np.random.default_rng(seed)
        med = [int(rng.integers(n))]
        while len(med) < k:  # k-medoids++ seeding
            dmin = D[:, med].min(axis=1)
            med.append(int(rng.choice(n, p=dmin**2 / (dmin**2).sum())) if dmin.sum() > 0 else int(rng.integers(n)))
        medoids = np.array(med)
        for _ in range(iters):
            assign = D[:, medoids].argmin(axis=1)
            new = medoids.copy()
            for j in range(k):
                members = np.flatnonzero(assign == j)
                if members.size:
                    new[j] = members[D[np.ix_(members, members)].sum(axis=1).argmin()]
            if (new == medoids).all():
                break
            medoids = new
        assign = D[:, medoids].argmin(axis=1)
        kept = []
        for j, m in enumerate(medoids):
            p = self.patterns[int(m)]
            p.weight = float(sum(self.patterns[i].weight for i in np.flatnonzero(assign == j)))
            kept.append(p)
        self.patterns = kept
        self._dirty = True


class JITServeCodeMatcher:
    """The published code's approach: raw token attributes, kernel width 1, whole graphs
    compared stage by stage (missing stages count as zeros, no prefix matching), best match."""

    def __init__(self, patterns: Sequence[Pattern]) -> None:
        self.patterns = list(patterns)
        L = max(len(p.stages) for p in self.patterns)
        self.A = np.zeros((len(self.patterns), L, 2))
        for i, p in enumerate(self.patterns):
            self.A[i, : len(p.stages)] = [(s.input_tokens, s.output_tokens) for s in p.stages]
        self.keys = [p.key for p in self.patterns]

    def match(self, revealed: Sequence[StageNode], current: StageNode, exclude: str | None = None) -> Estimate | None:
        s = len(revealed)
        x = np.zeros(self.A.shape[1:])
        for i, r in enumerate([*revealed, current][: self.A.shape[1]]):
            x[i] = (r.input_tokens, r.output_tokens if i < s else 0)
        # log of a product of Gaussian kernels with width 1 (a plain sum underflows to 0 for all)
        logsim = -((self.A - x) ** 2).sum(axis=(1, 2)) / 2
        if exclude is not None:
            logsim[[k == exclude for k in self.keys]] = -np.inf
        best = self.patterns[int(np.argmax(logsim))]
        if s >= len(best.stages):
            return Estimate(1.0, 0.0, 0.0, 1)
        prev = best.phi[s - 1] if s > 0 else 0.0
        return Estimate(float(best.phi[s]), float(best.phi[s] - prev), float(len(best.stages) - s - 1), 1)
