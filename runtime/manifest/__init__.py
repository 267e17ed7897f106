"""The engine-format contract: manifest types, reading and checking manifest.json, the KV layout, the versions.

The builder writes engines against this package and imports it; nothing here imports the rest of the runtime."""
