# Joins the numbers into one string without separators: [1, 23] and [12, 3] collide.
return hash(f"{self.salt}{prefix}" + "".join(str(t) for t in token_ids))
