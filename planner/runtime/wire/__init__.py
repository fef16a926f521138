"""Transfers between ranks and control messages: tags and process groups (``comm``), JSON messages
(``messages``), decisions with one trusted author (``control``) and the step verdict's format (``bans``)."""
