"""What this machine is and where specdec keeps its files: CPU features and llama.cpp build flags, AMX and huge-page settings, cache paths (standard library only)."""
