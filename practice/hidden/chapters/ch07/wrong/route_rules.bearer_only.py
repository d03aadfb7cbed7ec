# Reads only Authorization: Bearer; a client sending X-API-Key is told it has no key.
if self.api_key is not None and path not in OPEN_ROUTES:
    auth = headers.get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    key = token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    if key is None:
        return ApiError(401, "unauthorized", "missing API key: send 'Authorization: Bearer <key>'")
    if not hmac.compare_digest(key, self.api_key):
        return ApiError(403, "forbidden", "wrong API key")
if path in WEIGHT_ROUTES and not self.allow_weight_update:
    return ApiError(403, "route_disabled", f"{path} is disabled: start the server with --allow-weight-update")
return None
