"""The scheduler half of a connector whose decode engine pulls a finished prefill's blocks
(``SonarConnector``, ``NixlConnector``).

A prefill engine (``kv_producer`` or ``kv_both``) that finishes a request sent with
``kv_transfer_params: {"do_remote_decode": true}`` keeps its blocks and returns where they are
(its engine id, address, the request, the block ids, the prompt's length and hash). A decode
engine (``kv_consumer`` or ``kv_both``) given those parameters checks them against its own
request, asks for the blocks its prefix cache lacks (all but the last prompt token, which it
computes), and hands the worker one load per request, once: a request whose pull failed is
never pulled again. How the blocks move is the connector's worker half.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from typing import TYPE_CHECKING, Any

from sonar.kv_transfer.interface import KVConnector

if TYPE_CHECKING:
    from sonar.engine.request import Request
    from sonar.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def prompt_hash(token_ids: list[int]) -> str:
    """A digest of a prompt's token ids: the decode side checks it names the same prompt."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def check_remote_params(params: dict[str, Any], request: Request, block_size: int) -> str | None:
    """What is wrong with a decode request's ``kv_transfer_params`` (None: nothing)."""
    host, port, engine_id, remote_id, blocks = (
        params.get(k) for k in ("remote_host", "remote_port", "remote_engine_id", "remote_request_id", "remote_block_ids")
    )
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(remote_id, str) or not isinstance(engine_id, str):
        return "lack remote_host, remote_port, remote_engine_id or remote_request_id"
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 1 << 31 for b in blocks):
        return "have no valid remote_block_ids"
    if len(blocks) * block_size < request.num_prompt_tokens - 1:
        return f"name {len(blocks)} blocks, too few for a prompt of {request.num_prompt_tokens} tokens"
    if params.get("num_prompt_tokens") != request.num_prompt_tokens or params.get("prompt_hash") != prompt_hash(request.prompt_token_ids):
        return "describe another prompt than this request's"
    return None


class PullScheduling(KVConnector):
    """The shared scheduler half; a connector says what a load is (:meth:`make_load`) and what
    to do for a request that needs none of the remote blocks (:meth:`nothing_to_pull`), and
    builds its step metadata from ``_sends`` and ``_loads`` (then :meth:`forget_finished`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._address: dict[str, Any] | None = None  # this engine's KV port: host, port, engine_id
        self._sends: dict[str, list[int]] = {}  # finished prefills whose blocks a peer pulls
        self._loads: list[Any] = []
        self._pending: dict[str, int] = {}  # request -> its first block to pull
        self._attempted: set[str] = set()  # requests whose pull was scheduled once (never twice)

    def make_load(self, request_id: str, params: dict[str, Any], remote_block_ids: list[int], block_ids: list[int]) -> Any:
        """The worker's description of one request's pull into ``block_ids``."""
        raise NotImplementedError

    def nothing_to_pull(self, request: Request, params: dict[str, Any]) -> None:
        """The request's own prefix cache holds every block it would pull (default: nothing)."""

    def set_handshake_metadata(self, metadata: dict[str, Any] | None) -> None:
        self._address = metadata

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.sampling_params.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        req_id = request.request_id
        if req_id in self._attempted or request.num_output_tokens or request.sampling_params.prompt_logprobs is not None:
            return 0, False
        problem = check_remote_params(params, request, self.layout.block_size)
        if problem:
            self._attempted.add(req_id)
            logger.warning("request %s: kv_transfer_params %s; its prompt is computed here", req_id, problem)
            return 0, False
        num_external = request.num_prompt_tokens - 1 - num_computed_tokens
        if num_external <= 0:
            self.nothing_to_pull(request, params)
            return 0, False
        self._pending[req_id] = num_computed_tokens // self.layout.block_size
        return num_external, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        first = self._pending.pop(request.request_id, None)
        if first is None or num_external_tokens <= 0:
            return
        params = request.sampling_params.kv_transfer_params
        block_size = self.layout.block_size
        last = -(-(first * block_size + num_external_tokens) // block_size)
        self._attempted.add(request.request_id)
        self._loads.append(self.make_load(request.request_id, params, list(params["remote_block_ids"][first:last]), block_ids[first:last]))

    def forget_finished(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the state of the step's finished requests (after building its metadata)."""
        for req_id in scheduler_output.finished_req_ids:
            self._attempted.discard(req_id)
            self._pending.pop(req_id, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.sampling_params.kv_transfer_params
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        if request.status.value == "abort" or not block_ids or self._address is None:
            return False, None
        self._sends[request.request_id] = list(block_ids)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._address["engine_id"],
            "remote_host": self._address["host"],
            "remote_port": self._address["port"],
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "num_prompt_tokens": request.num_prompt_tokens,
            "prompt_hash": prompt_hash(request.prompt_token_ids),
            "tp_size": self.layout.tensor_parallel_size,
        }
