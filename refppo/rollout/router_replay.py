"""Replaying a mixture-of-experts model's routing (verl's ``router_replay.mode``).

A mixture-of-experts layer sends each token to the ``k`` experts its router scores highest. As
the actor's weights move during an update, a token's experts can change, and the update's
log-probs then come from a different network than the old log-probs they are compared with.
verl's router replay fixes the experts a token goes to, while the router's weights still learn
from the gradient of the weights it gives them:

- ``R2``: the old-log-prob pass records each router's top-k experts for every token; the actor's
  update replays them;
- ``R3``: the rollout records them while it samples; the old-log-prob pass and the update replay
  them (the response's last token, never fed back while sampling, keeps its own routing).

A replayed token's weights are the router's softmax over all experts taken at the recorded ones,
renormalised where the router renormalises its top k (verl 0.9's ``RouterReplay.get_replay_topk``
in ``verl/utils/megatron/router_replay_patch.py`` gathers its scores the same way). The recorded
experts travel in the batch as ``routed_experts`` (B, P + R, L, k), L the routers; -1 marks a
position without a record, which routes as the model does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch

# Hugging Face routers that weigh a token's top-k experts by the softmax over all experts at them:
# class name -> (renormalises the k weights: always, or as the router's attribute of that name
# says; returns them in the logits' dtype rather than float32)
ROUTERS = {
    "Qwen2MoeTopKRouter": ("norm_topk_prob", True),
    "Qwen3MoeTopKRouter": ("norm_topk_prob", True),
    "Qwen3NextTopKRouter": ("norm_topk_prob", True),
    "OlmoeTopKRouter": ("norm_topk_prob", True),
    "Qwen3_5MoeTopKRouter": (True, True),
    "Qwen3VLMoeTextTopKRouter": (True, True),
    "MixtralTopKRouter": (True, False),
}
UNRECORDED = -1


def replayed_weights(logits: torch.Tensor, experts: torch.Tensor, renormalise: bool, in_logits_dtype: bool):
    """A router's weights of given experts: softmax over all experts (in float32) at ``experts``,
    divided by their sum when ``renormalise``, cast to the logits' dtype when ``in_logits_dtype``.

    Args:
        logits: (N, E) router logits.
        experts: (N, k) int64 expert indices.
        renormalise, in_logits_dtype: the router's own rules (:data:`ROUTERS`).

    Returns:
        (N, k) weights.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, experts)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if in_logits_dtype else weights


class RouterReplay:
    """A model's routers, each of whose calls can be recorded or replayed (:data:`ROUTERS`).

    Recording collects every call's (N, k) experts per router; :meth:`routes_of_passes` and
    :meth:`routes_of_rollout` lay them out as a batch's ``routed_experts``. Replaying takes each
    micro-batch's targets from its ``routed_experts`` (:meth:`begin`, which :func:`replaying_passes`
    calls before each forward pass) and keeps them for the backward pass, whose recomputed layers
    (activation checkpointing) route again.

    Args:
        model: a causal LM whose routers are all of :data:`ROUTERS`.

    Raises:
        ValueError: a model without routers, or with one of another class.
    """

    def __init__(self, model):
        names = {type(m).__name__ for m in model.modules() if "Router" in type(m).__name__}
        if names - set(ROUTERS):
            raise ValueError(
                f"actor.router_replay: refppo replays the routers {', '.join(ROUTERS)}; the model has "
                f"{', '.join(sorted(names - set(ROUTERS)))}"
            )
        self.routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
        if not self.routers:
            raise ValueError("actor.router_replay needs a mixture-of-experts model: the model has no router")
        if max(router.num_experts for router in self.routers) > torch.iinfo(torch.int16).max:
            raise ValueError("actor.router_replay records experts as int16: the model has more than 32767 experts")
        self.top_k = self.routers[0].top_k
        for layer, router in enumerate(self.routers):
            router.forward = functools.partial(self._route, layer, router, router.forward)
        self.action: str | None = None
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.pieces: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []
        self.targets: torch.Tensor | None = None

    def _route(self, layer: int, router, route, hidden_states: torch.Tensor):
        """``router``'s forward (``route``) with its experts recorded, or replayed where a target is."""
        logits, weights, experts = route(hidden_states)
        if self.action == "record":
            self.calls[layer].append(experts.detach())
        if self.action == "replay" and self.targets is not None:
            target = self.targets[:, layer].to(device=experts.device, dtype=torch.long)
            recorded = (target[:, :1] != UNRECORDED).expand_as(target)
            renormalise, in_logits_dtype = ROUTERS[type(router).__name__]
            if isinstance(renormalise, str):
                renormalise = getattr(router, renormalise)
            replayed = replayed_weights(logits, target.clamp(min=0), renormalise, in_logits_dtype)
            weights = torch.where(recorded, replayed, weights)
            experts = torch.where(recorded, target, experts)
        return logits, weights, experts

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record every router call inside (R2's old-log-prob pass, R3's rollout)."""
        self.action = "record"
        self.calls = [[] for _ in self.routers]
        self.pieces = []
        try:
            yield
        finally:
            self.action = None

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Replay each micro-batch's ``routed_experts`` inside (set by :meth:`begin`)."""
        self.action = "replay"
        try:
            yield
        finally:
            self.action = None
            self.targets = None

    def begin(self, mb: dict[str, torch.Tensor]) -> None:
        """Before a forward pass over the micro-batch ``mb``: its targets when replaying (from
        ``mb["routed_experts"]`` (b, w, L, k)); a fresh record when recording."""
        if self.action == "replay":
            routes = mb["routed_experts"]
            self.targets = routes.reshape(-1, *routes.shape[2:])
        if self.action == "record":
            self.calls = [[] for _ in self.routers]

    def end(self, mb: dict[str, torch.Tensor]) -> None:
        """After a forward pass over ``mb`` when recording: its experts kept with its rows
        (``mb["router_row"]`` (b,)) and its prompt and response widths."""
        if self.action != "record":
            return
        rows = mb["router_row"]
        width_p = mb["prompts"].shape[1]
        width_r = mb["responses"].shape[1]
        routes = torch.stack([calls[-1] for calls in self.calls], dim=1)  # (b * w, L, k)
        self.pieces.append((rows, width_p, width_r, routes.reshape(len(rows), width_p + width_r, *routes.shape[1:])))

    def routes_of_passes(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The experts recorded over a pass of ``batch`` (B rows, P + R columns) by micro-batches,
        each placed at its rows and columns: (B, P + R, L, k) int16, -1 where no micro-batch
        reached (columns cut away as padding)."""
        width_p = batch["prompts"].shape[1]
        rows, width = batch["input_ids"].shape
        out = torch.full((rows, width, len(self.routers), self.top_k), UNRECORDED, dtype=torch.int16)
        out = out.to(batch["input_ids"].device)
        for piece_rows, piece_p, piece_r, routes in self.pieces:
            out[piece_rows.to(out.device), width_p - piece_p : width_p + piece_r] = routes.to(out)
        return out

    def routes_of_rollout(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The experts recorded while sampling ``batch`` (:func:`refppo.rollout.generation.generate`:
        one prefill over the P prompt columns, then one call per fed-back token): (B, P + R, L, k)
        int16, -1 at the last response column, whose token was never fed back."""
        rows, width = batch["input_ids"].shape
        per_router = []
        for calls in self.calls:
            steps = [call.reshape(rows, -1, call.shape[-1]) for call in calls]
            recorded = torch.cat(steps, dim=1)
            missing = recorded.new_full((rows, width - recorded.shape[1], recorded.shape[-1]), UNRECORDED)
            per_router.append(torch.cat([recorded, missing], dim=1))
        return torch.stack(per_router, dim=2).to(torch.int16)


def replaying_passes(passes, replay: RouterReplay):
    """``passes`` (:class:`refppo.rollout.forward.ForwardPasses`) whose log-prob and sum_pi_squared
    functions tell ``replay`` about each micro-batch before its forward pass and after it, so that
    a pass or an update inside :meth:`RouterReplay.recording` or :meth:`RouterReplay.replaying`
    records or replays it."""
    return dataclasses.replace(
        passes,
        log_probs=_telling(replay, passes.log_probs),
        sum_pi_squared=_telling(replay, passes.sum_pi_squared),
    )


def _telling(replay: RouterReplay, pass_fn):
    """``pass_fn(model, mb, ...)`` with ``replay`` told about ``mb`` before and after it."""

    def told(model, mb, *args, **kwargs):
        replay.begin(mb)
        result = pass_fn(model, mb, *args, **kwargs)
        replay.end(mb)
        return result

    return told


class Routing:
    """A PPO step's router replay by ``actor.router_replay``, doing nothing when it is disabled, so
    the step reads the same either way.

    - :meth:`sampling` / :meth:`keep_rollout_routes`: R3 records the rollout's routing;
    - :meth:`old_log_prob_pass`: R2 records the pass's routing, R3 replays the rollout's;
    - :meth:`replaying`: R2 and R3 replay the batch's ``routed_experts`` in the actor's update and
      in sum_pi_squared's pass;
    - :meth:`passes`: the actor's forward passes, telling the routers about each micro-batch.

    Args:
        model: the actor (its routers are patched unless ``mode`` is disabled).
        mode: ``actor.router_replay``: "disabled", "R2" or "R3".
    """

    def __init__(self, model, mode: str):
        self.mode = mode
        self.replay = None if mode == "disabled" else RouterReplay(model)

    def passes(self, passes):
        """``passes`` as :func:`replaying_passes` makes them when replaying, else unchanged."""
        return passes if self.replay is None else replaying_passes(passes, self.replay)

    def sampling(self) -> contextlib.AbstractContextManager:
        """The rollout's sampling: recorded under R3."""
        return self.replay.recording() if self.mode == "R3" else contextlib.nullcontext()

    def keep_rollout_routes(self, batch: dict[str, torch.Tensor]) -> None:
        """Under R3, the sampled ``batch``'s routing as its ``routed_experts`` (B, P + R, L, k)."""
        if self.mode == "R3":
            batch["routed_experts"] = self.replay.routes_of_rollout(batch)

    @contextlib.contextmanager
    def old_log_prob_pass(self, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """The old-log-prob pass over ``batch``: yields the batch to pass (under R2 with each row's
        number, ``router_row``), whose routing R2 records into ``batch["routed_experts"]`` and R3
        replays from it."""
        if self.mode == "R2":
            rows = torch.arange(len(batch["input_ids"]), device=batch["input_ids"].device)
            with self.replay.recording():
                yield batch | {"router_row": rows}
            batch["routed_experts"] = self.replay.routes_of_passes(batch)
        elif self.mode == "R3":
            with self.replay.replaying():
                yield batch
        else:
            yield batch

    def replaying(self) -> contextlib.AbstractContextManager:
        """Passes after the old-log-prob pass, each micro-batch's ``routed_experts`` replayed under
        R2 and R3: the actor's update, and sum_pi_squared's pass, routed as the old log-probs were."""
        return contextlib.nullcontext() if self.replay is None else self.replay.replaying()
