"""Watching the roots: the scanner (`scanner`) walks each root into a snapshot and its
candidates; a watcher (`watcher`: `inotify` or `polling`) only wakes a scan early. Nothing
here decides completeness (layouts do) or touches the store.
"""
