"""The bundled dataset's completion marker: what the builder writes last and the loader reads
to tell a complete build of the current version from a missing, partial or outdated one."""

MANIFEST = "manifest.json"
#: bumped when the builder's output changes, so stale folders are not mistaken for current
VERSION = 2  # 2: reproducible speech (seeded eSpeak NG noise, private library state) and mp4s
