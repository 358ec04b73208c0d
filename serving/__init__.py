"""Light serving engine (imported as tp_overlap_plugin.serving)."""
