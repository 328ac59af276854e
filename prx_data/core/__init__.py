"""Pure parts every stage builds on: schema, bucket math, imaging, hashing, storage paths."""
