        # why: when an Authorization header is present it is used even if its token is empty, without falling back to X-API-Key.
        if self.api_key is not None and path not in OPEN_ROUTES:
            auth = headers.get(b"authorization")
            if auth is not None:
                parts = auth.strip().split(None, 1)
                key = parts[1].strip() if len(parts) == 2 and parts[0].lower() == b"bearer" else b""
            else:
                key = headers.get(b"x-api-key", b"").strip()
            if not key:
                return ApiError(401, "unauthorized", "no API key: send Authorization: Bearer <key> or X-API-Key")
            if not hmac.compare_digest(key, self.api_key):
                return ApiError(403, "forbidden", "wrong API key")
        if not self.allow_weight_update and path in WEIGHT_ROUTES:
            return ApiError(403, "route_disabled", f"{path} is disabled; start the server with --allow-weight-update")
        return None
