"""Watching the roots: the scanner (`scanner`) walks each root (`walk`) into a snapshot and its
candidates, keeping finished checkpoint directories as judged (`kept`); a watcher (`watcher`:
`inotify` or `polling`) wakes a scan early and names the directories that changed, so a rescan
lists only those while inotify vouches for the root. Nothing here decides completeness
(layouts do) or touches the store.
"""
