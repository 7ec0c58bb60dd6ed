"""The process: environment variables checked at start, Ctrl-C and SIGTERM, stdout on a closed pipe or a full
disk, logging and the GPU (common), progress lines and the time a run has left, the set-up checks run by make."""
