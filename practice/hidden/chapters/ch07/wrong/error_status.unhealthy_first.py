# Checks the engine's health first: an unhealthy engine answers 503 unhealthy to everything,
# a paused engine's retryable 503 and a bad payload's 400 included.
if isinstance(exc, ApiError):
    return exc
if getattr(engine, "unhealthy", None):
    return ApiError(503, "unhealthy", f"engine is unhealthy and refuses work until restarted: {engine.unhealthy}")
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
log.error("engine call failed", exc_info=exc)
return ApiError(500, "internal", f"{type(exc).__name__}: {exc}")
