# Messages carry str(exc), the address audit's too: the client is never told that the engine now
# refuses work until it is restarted.
if isinstance(exc, ApiError):
    return exc
if isinstance(exc, EnginePausedError):
    return ApiError(503, "paused", str(exc), retryable=True)
if isinstance(exc, EngineBusyError):
    return ApiError(409, "conflict", str(exc))
if isinstance(exc, UnsafePickleError):
    return ApiError(400, "unsafe_payload", str(exc))
if isinstance(exc, AddressMovedError):
    return ApiError(500, "address_moved", str(exc))
if isinstance(exc, TimeoutError):
    return ApiError(504, "timeout", str(exc), retryable=True)
if isinstance(exc, ValueError):  # UpdateError, CheckpointError, BucketError: nothing was changed
    return ApiError(400, "bad_request", str(exc))
if getattr(engine, "unhealthy", None):
    return ApiError(503, "unhealthy", f"engine is unhealthy and refuses work until restarted: "
                                      f"{engine.unhealthy}")
log.error("engine call failed", exc_info=exc)
return ApiError(500, "internal", f"{type(exc).__name__}: {exc}")
