"""Stop rules applied to newly sampled tokens."""
from __future__ import annotations

from tokenbudget.core.request import Request, RequestStatus


def check_stop(req: Request, new_token_ids: list[int],
               max_model_len: int) -> tuple[RequestStatus | None, list[int]]:
    """Append ``new_token_ids`` to ``req`` one by one, stopping at the first
    stop condition; tokens past a stop are dropped. Returns the finished
    status (or None) and the tokens kept."""
    params = req.sampling_params
    eos = None if params.ignore_eos else req.eos_token_id
    stop_ids = params.stop_token_ids
    for k, token in enumerate(new_token_ids):
        req.output_token_ids.append(token)
        req.all_token_ids.append(token)
        n_out = len(req.output_token_ids)
        status = None
        # min_tokens holds back EOS and stop ids, never the length limits.
        if n_out >= params.min_tokens:
            if token == eos:
                status = RequestStatus.FINISHED_STOPPED
            elif stop_ids and token in stop_ids:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
        if status is None and (n_out >= req.max_tokens or len(req.all_token_ids) >= max_model_len):
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        if status is not None:
            return status, new_token_ids[:k + 1]
    return None, new_token_ids
