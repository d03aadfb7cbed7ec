# A 401 that says only "missing API key": the client is not told which headers may carry one.
if self.api_key is not None and path not in OPEN_ROUTES:
    key = None
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            key = token.strip()
    if key is None:
        fallback = headers.get(b"x-api-key", b"").strip()
        key = fallback or None
    if key is None:
        return ApiError(401, "unauthorized", "missing API key")
    if not hmac.compare_digest(key, self.api_key):
        return ApiError(403, "forbidden", "wrong API key")
if path in WEIGHT_ROUTES and not self.allow_weight_update:
    return ApiError(403, "route_disabled", f"{path} is disabled: start the server with "
                                           f"--allow-weight-update to enable weight routes")
return None
