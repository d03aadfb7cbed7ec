    # why: answers unknown errors with 500 internal but never logs them with their traceback.
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EnginePausedError):
        return ApiError(503, "paused", str(exc), retryable=True)
    if isinstance(exc, EngineBusyError):
        return ApiError(409, "conflict", str(exc))
    if isinstance(exc, UnsafePickleError):
        return ApiError(400, "unsafe_payload", str(exc))
    if isinstance(exc, AddressMovedError):
        return ApiError(500, "address_moved", f"{exc}; the engine refuses work until restarted")
    if isinstance(exc, TimeoutError):
        return ApiError(504, "timeout", str(exc), retryable=True)
    if isinstance(exc, ValueError):
        return ApiError(400, "bad_request", str(exc))
    reason = getattr(engine, "unhealthy", None)
    if reason:
        return ApiError(503, "unhealthy", f"{exc} (engine unhealthy: {reason})")
    return ApiError(500, "internal", str(exc))
