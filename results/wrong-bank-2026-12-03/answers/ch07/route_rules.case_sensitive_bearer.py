        # why: accepts only the exact scheme "Bearer", so "bearer <key>" falls through and is refused.
        if self.api_key is not None and path not in OPEN_ROUTES:
            key = None
            auth = headers.get(b"authorization", b"")
            if auth.startswith(b"Bearer ") and auth[7:].strip():
                key = auth[7:].strip()
            if key is None:
                key = headers.get(b"x-api-key", b"").strip() or None
            if not key:
                return ApiError(401, "unauthorized", "no API key: send Authorization: Bearer <key> or X-API-Key")
            if not hmac.compare_digest(key, self.api_key):
                return ApiError(403, "forbidden", "wrong API key")
        if not self.allow_weight_update and path in WEIGHT_ROUTES:
            return ApiError(403, "route_disabled", f"{path} is disabled; start the server with --allow-weight-update")
        return None
