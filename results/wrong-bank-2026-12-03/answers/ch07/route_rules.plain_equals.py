        # why: compares the key with ==, which stops at the first differing byte and leaks a prefix by timing.
        if self.api_key is not None and path not in OPEN_ROUTES:
            key = None
            parts = headers.get(b"authorization", b"").strip().split(None, 1)
            if len(parts) == 2 and parts[0].lower() == b"bearer" and parts[1].strip():
                key = parts[1].strip()
            if key is None:
                key = headers.get(b"x-api-key", b"").strip() or None
            if not key:
                return ApiError(401, "unauthorized", "no API key: send Authorization: Bearer <key> or X-API-Key")
            if key != self.api_key:
                return ApiError(403, "forbidden", "wrong API key")
        if not self.allow_weight_update and path in WEIGHT_ROUTES:
            return ApiError(403, "route_disabled", f"{path} is disabled; start the server with --allow-weight-update")
        return None
