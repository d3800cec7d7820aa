// the page (being written)
