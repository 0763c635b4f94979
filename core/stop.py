"""Stop rules applied to newly sampled tokens."""

from __future__ import annotations

from tokenbudget.core.request import Request, RequestStatus


def check_stop(
    req: Request, new_token_ids: list[int], max_model_len: int
) -> tuple[RequestStatus | None, list[int]]:
    """Append ``new_token_ids`` to ``req`` one by one, stopping at the first
    stop condition; tokens past a stop are dropped. Returns the finished
    status (or None) and the tokens kept."""
    params = req.sampling_params
    eos = None if params.ignore_eos else req.eos_token_id
    stop_ids = params.stop_token_ids
    min_tokens = params.min_tokens
    max_tokens = req.max_tokens
    outputs = req.output_token_ids
    all_ids = req.all_token_ids
    for k, token in enumerate(new_token_ids):
        outputs.append(token)
        all_ids.append(token)
        n_out = len(outputs)
        # min_tokens holds back EOS and stop ids, never the length limits.
        if n_out >= min_tokens:
            if token == eos:
                return RequestStatus.FINISHED_STOPPED, new_token_ids[: k + 1]
            if stop_ids and token in stop_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED, new_token_ids[: k + 1]
        if n_out >= max_tokens or len(all_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED, new_token_ids[: k + 1]
    return None, new_token_ids
