"""Event sources that run continuously (process exits, the kernel log, ...), each turning
what it sees into events on the timeline."""
