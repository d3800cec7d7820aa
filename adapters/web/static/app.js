/* cortex-bot's web page: what the bot keeps about you, to read, correct and delete.
 *
 * Plain DOM, no libraries, no build step. The Content-Security-Policy allows nothing inline, so every
 * element is built here with createElement/textContent; the only HTML inserted as such is the server's
 * rendered Markdown ("html" fields), in which any raw HTML of the text is already escaped.
 */
'use strict';

(function () {
  const SESSION_ENDED = 'Your session ended: send !dashboard in a chat for a new link';
  const TABS = ['files', 'items', 'activity', 'export', 'admin'];
  const FILE_INFO = {
    'memory.md': 'What the persona remembers about you',
    'soul.md': 'Who the persona is becoming',
    'relationship.md': 'How the two of you get along',
  };
  const CATEGORIES = ['fact', 'preference', 'decision', 'user_info', 'project_context', 'learned_behavior',
    'correction', 'temporal', 'event'];
  const JOB_STATUSES = ['queued', 'running', 'failed', 'done'];
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const DIFF_CONTEXT = 3;

  const state = {
    me: null,
    csrf: '',
    persona: '',
    tab: 'files',
    file: 'memory.md',
    files: {},
    filesFor: '',
    fileMode: 'view',
    draft: null,
    diff: { from: 0, to: 0 },
    items: { query: '', category: '', pinned: '', scope: '', archived: 'false', page: 1 },
    editingItem: 0,
    itemDraft: null,  // the correction typed into the item editor (a reload of the list keeps it)
    focusItemEditor: false,  // the editor was just opened: it takes the keyboard (once)
    routed: null,  // the address the page shows (Back/Forward away from unsaved text goes back to it)
    adminSection: '',
    overview: null,
    jobStatus: '',
    settingsFor: { persona: '', server: '' },
    guidelinesServer: '',
    seq: 0,
  };

  // -- small DOM helpers ------------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;
  const PROPS = new Set(['value', 'checked', 'disabled', 'hidden', 'selected', 'readOnly', 'multiple']);

  function append(parent, kids) {
    for (const kid of kids) {
      if (kid === null || kid === undefined || kid === false) continue;
      if (Array.isArray(kid)) append(parent, kid);
      else if (kid instanceof Node) parent.appendChild(kid);
      else parent.appendChild(document.createTextNode(String(kid)));
    }
    return parent;
  }

  function props(el, attrs) {
    if (!attrs) return el;
    for (const [key, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === 'text') el.textContent = String(value);
      else if (key === 'testid') el.setAttribute('data-testid', value);
      else if (key.startsWith('on') && typeof value === 'function') el.addEventListener(key.slice(2), value);
      else if (PROPS.has(key)) {
        el[key] = value;
        if (key === 'value' && el.tagName === 'TEXTAREA') el.defaultValue = String(value);  // (see unsavedTexts)
      } else el.setAttribute(key, value === true ? '' : String(value));
    }
    return el;
  }

  /** Replaces the children of ``el`` (arrays among them flattened, null left out). */
  function fill(el, ...kids) {
    el.replaceChildren();
    return append(el, kids);
  }

  /** An HTML element: h('button', {class: 'btn', onclick: f}, 'Save'). */
  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    append(el, kids);
    return props(el, attrs);
  }

  /** An SVG element, the same way. */
  function s(tag, attrs, ...kids) {
    const el = document.createElementNS(SVG_NS, tag);
    append(el, kids);
    return props(el, attrs);
  }

  function button(label, onclick, attrs) {
    return h('button', Object.assign({ type: 'button', class: 'btn', onclick }, attrs || {}), label);
  }

  function field(label, control, hint) {
    const id = control.id || `f-${Math.random().toString(36).slice(2, 9)}`;
    control.id = id;
    return h('div', { class: 'field' }, h('label', { for: id }, label), control,
      hint ? h('p', { class: 'hint' }, hint) : null);
  }

  function select(options, value, attrs) {
    const el = h('select', attrs || {}, options.map(([v, label]) => h('option', { value: v }, label)));
    el.value = value;
    return el;
  }

  function chip(text, kind) {
    return h('span', { class: `chip${kind ? ` chip-${kind}` : ''}` }, text);
  }

  function empty(text) {
    return h('p', { class: 'empty' }, text);
  }

  function loading(container) {
    fill(container, h('p', { class: 'loading' }, 'Loading…'));
  }

  /** A table from column specs [{label, cell(row) -> node|string, class}] and rows. */
  function table(columns, rows, options) {
    const { rowAttrs, ...attrs } = options || {};
    return h('div', { class: 'table-wrap' },
      h('table', attrs,
        h('thead', null, h('tr', null, columns.map((c) => h('th', { scope: 'col', class: c.class }, c.label)))),
        h('tbody', null, rows.map((row) => {
          const tr = h('tr', null, columns.map((c) => h('td', { class: c.class, 'data-label': c.label || null }, c.cell(row))));
          if (rowAttrs) props(tr, rowAttrs(row));
          return tr;
        }))));
  }

  // -- formatting -------------------------------------------------------------------------------

  const dateTime = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });
  const thisYear = new Intl.DateTimeFormat(undefined, { month: 'short', day: 'numeric', hour: 'numeric', minute: '2-digit' });
  const dayOnly = new Intl.DateTimeFormat(undefined, { month: 'short', day: 'numeric' });
  const timeOnly = new Intl.DateTimeFormat(undefined, { hour: '2-digit', minute: '2-digit' });

  function toMs(value) {
    if (value === null || value === undefined || value === '') return NaN;
    if (typeof value === 'number') return value < 1e12 ? value * 1000 : value;
    const asNumber = Number(value);
    if (!Number.isNaN(asNumber)) return toMs(asNumber);
    return Date.parse(value);
  }

  function fmtDate(value) {
    const ms = toMs(value);
    if (Number.isNaN(ms)) return '—';
    const when = new Date(ms);
    return (when.getFullYear() === new Date().getFullYear() ? thisYear : dateTime).format(when);
  }

  function fmtInt(value) {
    const n = Number(value);
    return Number.isFinite(n) ? n.toLocaleString() : '—';
  }

  function fmtDuration(ms) {
    const n = Number(ms);
    if (!Number.isFinite(n)) return '—';
    return n < 1000 ? `${Math.round(n)} ms` : `${(n / 1000).toFixed(1)} s`;
  }

  function fmtValue(value) {
    if (value === null || value === undefined) return '—';
    if (typeof value === 'object') return JSON.stringify(value);
    return String(value);
  }

  function plural(n, word) {
    return `${fmtInt(n)} ${word}${Number(n) === 1 ? '' : 's'}`;
  }

  function authorName(author) {
    if (author === 'model') return state.persona || 'the persona';
    if (author === 'user') return 'you';
    if (author === 'system') return 'the bot';
    return author || '—';
  }

  function authorText(version) {
    if (version.author === 'model') return `written by ${state.persona}`;
    if (version.author === 'user') return 'changed by you';
    return 'set up by the bot';
  }

  // -- talking to the bot -----------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  /** One request, sent as the user the page shows (``asShown``; not before it knows them): a login in another
   * tab of this browser may have given the session cookie to someone else, and a read carries no CSRF token, so
   * only the server can tell that the answer would be theirs (a 409 "other_user" instead). */
  async function send(method, path, body, asShown) {
    const init = { method, credentials: 'same-origin', headers: { Accept: 'application/json' } };
    if (method !== 'GET') init.headers['X-CSRF-Token'] = state.csrf;
    if (asShown && state.me) init.headers['X-Cortex-User'] = enc(state.me.user.key);  // (a key may be any text)
    if (body !== undefined) {
      init.headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    try {
      return await fetch(path, init);
    } catch (err) {
      throw new ApiError(0, 'The bot cannot be reached right now: check the connection and try again.');
    }
  }

  async function jsonOf(response) {
    if (!(response.headers.get('Content-Type') || '').includes('application/json')) return null;
    try {
      return await response.json();
    } catch (err) {
      return null;
    }
  }

  /** The answer to a request as the page's user, when it is ok. A refused CSRF token or another user's session
   * (both from a login in another tab) is first looked into by renewToken: the same person's new token is
   * tried once more, someone else's login ends the page. Any other refusal throws its ApiError. */
  async function request(method, path, body, retried) {
    const response = await send(method, path, body, true);
    if (response.ok) return response;
    const data = await jsonOf(response);
    const code = data && data.code;
    const otherLogin = (response.status === 403 && code === 'csrf') || (response.status === 409 && code === 'other_user');
    if (otherLogin && !retried && state.me && await renewToken()) return request(method, path, body, true);
    throw errorOf(response, data);
  }

  async function api(method, path, body) {
    return jsonOf(await request(method, path, body));
  }

  function errorOf(response, data) {
    const message = data && typeof data.error === 'string' ? data.error : `${response.status} ${response.statusText}`;
    return new ApiError(response.status, message);
  }

  /** A login in another tab of this browser gave the session cookie a new token: the same person's page goes on
   * with it; another person's login ends this page (its changes would land in their memory, its reads show
   * theirs). Asks who is logged in without naming this page's user (which the server would refuse). */
  async function renewToken() {
    let me;
    try {
      const response = await send('GET', '/api/me', undefined, false);
      me = response.ok ? await jsonOf(response) : null;
    } catch (err) {
      me = null;
    }
    if (!me) return false;  // (a 401: no session at all; the caller says it ended)
    if (!me.user || me.user.key !== state.me.user.key) {
      sessionEnded('Someone else logged in', ['This browser is now logged in as ', h('strong', null,
        (me.user && (me.user.name || me.user.key)) || 'another user'), ' (in another tab): reload the page to ',
        'see their memory, or send ', h('code', null, '!dashboard'), ' in a chat for your own login link.']);
      return false;
    }
    state.csrf = me.csrf;
    state.me.session_expires_at = me.session_expires_at;
    sessionInfo();
    return true;
  }

  const personaPath = () => `/api/me/personas/${enc(state.persona)}`;
  const filePath = (file) => `${personaPath()}/files/${enc(file)}`;

  // -- messages ---------------------------------------------------------------------------------

  let noticeTimer = 0;
  let alertOf = null;  // the part whose failed load the alert tells of (null: an action's failure)

  function showError(err) {
    alertOf = null;
    const status = err instanceof ApiError ? err.status : -1;
    if (status === 401 && state.me) {  // (nothing on the page works any more: say so, keep what was typed)
      sessionEnded();
      return;
    }
    if (state.me && $('app').hidden) return;  // (the page ended: its end screen says why)
    const text = status === 401 ? SESSION_ENDED : (err && err.message) || String(err);
    const box = $('alert');
    $('alert-text').textContent = text;
    box.dataset.status = String(status);
    box.hidden = false;
    $('notice').textContent = '';
  }

  function clearAlert() {
    alertOf = null;
    $('alert').hidden = true;
  }

  /** A passing word on what an action did. The box stays in the page (empty, it takes no room): a live region
   * shown at the moment its text changes is not read out by every screen reader. */
  function notify(text) {
    const box = $('notice');
    box.textContent = text;
    clearTimeout(noticeTimer);
    noticeTimer = setTimeout(() => { box.textContent = ''; }, 8000);
  }

  /** Runs an action: clears the old error, shows a new one, disables the button meanwhile. */
  async function attempt(fn, trigger) {
    clearAlert();
    const hadFocus = Boolean(trigger) && document.activeElement === trigger;
    if (trigger) trigger.disabled = true;  // (a disabled button loses the keyboard: given back below)
    try {
      return await fn();
    } catch (err) {
      showError(err);
      return undefined;
    } finally {
      if (trigger && trigger.isConnected) {
        trigger.disabled = false;
        if (hadFocus && document.activeElement === document.body) trigger.focus();
      }
    }
  }

  /** Loads a part of the page; a failure shows in the alert area and, briefly, where the part would be. */
  const loads = new WeakMap();

  async function section(container, what, fn, quiet) {
    const seq = ++state.seq;
    loads.set(container, seq);
    const kept = quiet && container.childElementCount > 0;  // (a reload: the old rows stay until the new ones come)
    const focused = document.activeElement;
    const memo = focused && focused !== container && container.contains(focused) ? focusMemo(focused) : null;
    if (!kept) loading(container);
    try {
      await fn(() => loads.get(container) !== seq || !container.isConnected);
      if (loads.get(container) === seq && alertOf === container) clearAlert();  // (its earlier failure is over)
      if (memo && loads.get(container) === seq) restoreFocus(container, memo);
    } catch (err) {
      if (loads.get(container) !== seq) return;
      showError(err);
      alertOf = container;
      if (kept) return;  // (the alert says what failed; what was there stays)
      fill(container, h('p', { class: 'failed', testid: 'load-failed' },
        `Could not load ${what}: ${err instanceof ApiError && err.status === 401 ? SESSION_ENDED : err.message}`));
    }
  }

  /** Text typed into the page's editors and not saved (each editor's first text is its defaultValue). */
  function unsavedTexts() {
    return [...$('app').querySelectorAll('textarea')]
      .filter((area) => (area.dataset.unsaved || (!area.readOnly && area.value !== area.defaultValue)) && area.value.trim())
      .map((area) => area.value);
  }

  /** Whether the page may leave what is being edited: nothing unsaved, or the person says so (and then what
   * was typed is let go of, so that nothing asks about it again). */
  function leaveEditor() {
    if (unsavedTexts().length && !window.confirm('Leave the editor? Your changes are not saved.')) return false;
    for (const area of $('app').querySelectorAll('textarea:not([readonly])')) area.value = area.defaultValue;
    for (const area of $('app').querySelectorAll('textarea[data-unsaved]')) delete area.dataset.unsaved;
    if (state.fileMode === 'edit') state.fileMode = 'view';
    state.draft = null;
    state.editingItem = 0;
    state.itemDraft = null;
    return true;
  }

  function sessionEnded(title, text) {
    if ($('app').hidden) return;  // (told once: a later failure would find the editors gone)
    const unsaved = unsavedTexts();
    ended(title || 'Your session ended', text || chatHint(), unsaved.length ? [
      h('p', { class: 'hint' }, 'What you typed was not saved: copy it before you close this page.'),
      unsaved.map((text) => h('textarea', { readOnly: true, rows: '8', value: text, 'aria-label': 'Your unsaved text',
        testid: 'unsaved-text' })),
    ] : null);
  }

  /** What identifies a control across a re-render of its part of the page (the part's buttons are new ones). */
  function focusMemo(el) {
    return { tag: el.tagName, testid: el.dataset.testid || '', label: el.getAttribute('aria-label') || '',
      text: (el.textContent || '').trim() };
  }

  /** After a part of the page was drawn again, the keyboard goes back to the same control, or to the part's
   * heading (not to the top of the page, where a keyboard user would start over). */
  function restoreFocus(container, memo) {
    const now = document.activeElement;
    if (now && now !== document.body) return;  // (something took it on purpose: an editor, a refocus)
    const alike = [...container.querySelectorAll(memo.tag)].filter((el) => (memo.testid
      ? el.dataset.testid === memo.testid : memo.label ? el.getAttribute('aria-label') === memo.label
        : Boolean(memo.text) && (el.textContent || '').trim() === memo.text));
    const same = alike.length === 1 ? alike[0] : null;  // (one of several "Edit" buttons: which one is unknown)
    if (same) same.focus();
    if (same && document.activeElement === same) return;  // (else it is disabled, or in a closed <details>)
    const heading = container.querySelector('h2, h3');
    if (!heading) return;
    heading.tabIndex = -1;
    heading.focus();
  }

  function ended(title, text, more) {
    forgetShown();
    $('app').hidden = true;
    $('who').hidden = true;
    $('loading').hidden = true;
    $('session-info').textContent = '';
    $('footer-note').hidden = true;  // (nothing is shown any more: nothing to correct here)
    $('ended-title').textContent = title;
    fill($('ended-text'), text);
    fill($('ended-more'), more || null);
    $('ended').hidden = false;
    $('ended-title').focus();  // (a screen reader reads where the page went)
  }

  /** Nothing of the user stays in the page once it ended (a logout, a forget-me, someone else's login): hidden
   * panels still held their memory, files and items for whoever used the browser next (its developer tools,
   * or Back, which drew the files again from what the page kept), nor their persona pick in the browser's storage.
   * Loads still under way land nowhere. */
  function forgetShown() {
    for (const name of TABS) {
      const panel = $(`panel-${name}`);
      loads.set(panel, ++state.seq);
      panel.replaceChildren();
    }
    fill($('persona'));
    $('persona-hint').textContent = '';
    $('user-name').textContent = '';
    $('user-name').title = '';
    Object.assign(state, { files: {}, filesFor: '', draft: null, itemDraft: null, overview: null });
    try {
      localStorage.removeItem('cortexbot.persona');  // (their last pick: the next person starts on the default)
    } catch (err) {
      /* private mode: nothing was kept */
    }
  }

  function chatHint() {
    return ['Send ', h('code', null, '!dashboard'), ' (or ', h('code', null, '/dashboard'),
      ' on Discord) in a chat with the bot for a new login link.'];
  }

  // -- start, header, routing -------------------------------------------------------------------

  function canAdmin() {
    return Boolean(state.me && (state.me.is_bot_admin || (state.me.admin_servers || []).length));
  }

  function loadPreference(key, fallback) {
    try {
      return localStorage.getItem(`cortexbot.${key}`) || fallback;
    } catch (err) {
      return fallback;
    }
  }

  function savePreference(key, value) {
    try {
      localStorage.setItem(`cortexbot.${key}`, value);
    } catch (err) {
      /* private mode: the choice lasts this page view only */
    }
  }

  async function boot() {
    $('alert-close').addEventListener('click', clearAlert);
    $('logout').addEventListener('click', () => logout(false));
    $('logout-all').addEventListener('click', () => logout(true));
    $('persona').addEventListener('change', (event) => choosePersona(event.target.value));
    $('tabs').addEventListener('keydown', tabKeys);
    for (const tab of document.querySelectorAll('[role="tab"][data-tab]')) {
      tab.addEventListener('click', () => {
        clearAlert();
        go(tab.dataset.tab);
      });
    }
    window.addEventListener('hashchange', route);
    window.addEventListener('beforeunload', (event) => {  // a reload or a closed tab loses the editors' text
      if (!$('app').hidden && unsavedTexts().length) event.preventDefault();
    });
    try {
      state.me = await api('GET', '/api/me');
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) ended('You are not logged in', chatHint());
      else {
        $('loading').hidden = true;
        showError(err);
      }
      return;
    }
    state.csrf = state.me.csrf;
    $('user-name').textContent = state.me.user.name || state.me.user.key;
    $('user-name').title = state.me.user.key;
    $('who').hidden = false;
    const personas = state.me.personas || [];
    const picker = $('persona');
    fill(picker, personas.map((p) => h('option', { value: p.name },
      p.talked ? p.name : `${p.name} (not talked yet)`)));
    const remembered = loadPreference('persona', '');
    const first = personas.find((p) => p.talked) || personas[0];
    state.persona = personas.some((p) => p.name === remembered) ? remembered : (first ? first.name : '');
    picker.value = state.persona;
    personaHint();
    $('tab-admin').hidden = !canAdmin();
    sessionInfo();
    $('loading').hidden = true;
    $('app').hidden = false;
    route();
  }

  let sessionTimer = 0;

  function sessionInfo() {
    const ends = toMs(state.me.session_expires_at);
    if (Number.isNaN(ends)) return;
    $('session-info').textContent = `This login lasts until ${fmtDate(ends)}.`;
    const wait = ends - Date.now();
    clearTimeout(sessionTimer);
    if (wait < 2 ** 31 - 1) sessionTimer = setTimeout(sessionOver, Math.max(wait, 0));
  }

  /** The login's time is up: unless a login in another tab of this browser started a new session meanwhile. */
  async function sessionOver() {
    const before = state.me.session_expires_at;
    if (!await renewToken()) {
      sessionEnded();
    } else if (state.me.session_expires_at === before) {  // (still valid: this browser's clock runs ahead)
      clearTimeout(sessionTimer);
      sessionTimer = setTimeout(sessionOver, 60_000);
    }
  }

  function personaHint() {
    const persona = (state.me.personas || []).find((p) => p.name === state.persona);
    const hint = $('persona-hint');
    if (!persona) {
      hint.textContent = 'The bot has no personas.';
      return;
    }
    hint.textContent = persona.talked
      ? `What ${persona.name} keeps about you (${persona.language}).`
      : `You have not talked with ${persona.name} yet: these are the starting files.`;
  }

  function choosePersona(name) {
    if (!leaveEditor()) {
      $('persona').value = state.persona;
      return;
    }
    state.persona = name;
    state.files = {};
    state.filesFor = '';
    state.fileMode = 'view';
    state.diff = { from: 0, to: 0 };
    state.items.page = 1;
    savePreference('persona', name);
    personaHint();
    clearAlert();
    showTab();
  }

  function go(tab, sub) {
    const hash = `#/${tab}${sub ? `/${sub}` : ''}`;
    if (location.hash !== hash) location.hash = hash;
    else if (!unsavedTexts().length) route();  // (drawn again: an editor's typed text would go)
  }

  function route() {
    if (!state.me || !$('ended').hidden) return;  // (the page ended: nothing is drawn again)
    // Another tab, admin section, or Back/Forward: unsaved text is asked about first (kept: the address goes back).
    if (state.routed !== null && location.hash !== state.routed && !leaveEditor()) {
      history.pushState(null, '', state.routed || location.pathname);  // (Back then asks again)
      return;
    }
    state.routed = location.hash;
    const [tab, sub] = location.hash.replace(/^#\/?/, '').split('/');
    state.tab = TABS.includes(tab) && (tab !== 'admin' || canAdmin()) ? tab : 'files';
    if (state.tab === 'admin') state.adminSection = sub || state.adminSection;
    for (const button of document.querySelectorAll('[role="tab"][data-tab]')) {
      const selected = button.dataset.tab === state.tab;
      button.setAttribute('aria-selected', String(selected));
      button.tabIndex = selected ? 0 : -1;
    }
    for (const name of TABS) $(`panel-${name}`).hidden = name !== state.tab;
    $('persona-bar').hidden = state.tab === 'admin';
    showTab();
  }

  function tabKeys(event) {
    const tabs = [...document.querySelectorAll('[role="tab"][data-tab]')].filter((t) => !t.hidden);
    const at = tabs.indexOf(document.activeElement);
    if (at < 0) return;
    const moves = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: tabs.length - 1 };
    if (!(event.key in moves)) return;
    event.preventDefault();
    const next = tabs[(moves[event.key] + tabs.length) % tabs.length];
    next.focus();
    go(next.dataset.tab);
  }

  function showTab() {
    const shows = { files: showFiles, items: showItems, activity: showActivity, export: showExport, admin: showAdmin };
    shows[state.tab]();
  }

  async function logout(everywhere) {
    if (!leaveEditor()) return;
    try {
      await api('POST', everywhere ? '/api/logout?everywhere=1' : '/api/logout');
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 401)) {
        showError(err);
        return;
      }
    }
    clearAlert();
    const title = everywhere ? 'You are logged out everywhere' : 'You are logged out';
    ended(title, ['To come back, send ', h('code', null, '!dashboard'),
      ' in a chat with the bot for a new login link.']);
  }

  // -- Files ------------------------------------------------------------------------------------

  async function showFiles() {
    const panel = $('panel-files');
    if (state.filesFor === state.persona && state.files[state.file]) {
      renderFiles();
      return;
    }
    await section(panel, 'your files', async (stale) => {
      const data = await api('GET', `${personaPath()}/files`);
      if (stale()) return;
      state.files = {};
      for (const version of data.files) state.files[version.file] = version;
      state.filesFor = state.persona;
      renderFiles();
    });
  }

  function renderFiles() {
    const was = document.activeElement && document.activeElement.dataset ? document.activeElement.dataset.testid : '';
    drawFiles();
    const now = document.activeElement;
    if (now && now !== document.body) return;  // (the editor took the keyboard)
    const same = was ? document.querySelector(`#panel-files [data-testid="${CSS.escape(was)}"]`) : null;
    const target = same || $('file-title');
    if (target) target.focus();
  }

  function drawFiles() {
    const panel = $('panel-files');
    const list = h('nav', { class: 'file-list', 'aria-label': 'Your files' },
      state.me.files.map((name) => {
        const version = state.files[name];
        return h('button', {
          type: 'button', class: 'file-pick', testid: `file-${name}`,
          'aria-current': name === state.file ? 'true' : null,
          onclick: () => openFile(name),
        }, h('span', { class: 'file-name' }, name), h('span', { class: 'file-about' }, FILE_INFO[name] || ''),
        version ? h('span', { class: 'file-size' }, `version ${version.version} · ${plural(version.chars, 'character')}`)
          : null);
      }));
    const view = h('article', { class: 'card file-view', id: 'file-view', 'aria-labelledby': 'file-title' });
    fill(panel, h('div', { class: 'files-layout' }, list, view));
    renderFileView(view);
  }

  function openFile(name) {
    if (!leaveEditor()) return;
    state.file = name;
    state.fileMode = 'view';
    state.diff = { from: 0, to: 0 };
    clearAlert();
    renderFiles();
  }

  function setMode(mode) {
    const next = state.fileMode === mode ? 'view' : mode;  // (a toggle: Edit again while editing closes it)
    if (state.fileMode === 'edit' && !leaveEditor()) return;  // (which sets the mode to view)
    state.fileMode = next;
    state.draft = null;
    clearAlert();
    renderFiles();
  }

  function renderFileView(view) {
    const version = state.files[state.file];
    if (!version) {
      fill(view, empty('This file is not there.'));
      return;
    }
    const mode = state.fileMode;
    const head = h('header', { class: 'file-head' },
      h('div', { class: 'file-title' },
        h('h2', { id: 'file-title', tabindex: '-1' }, state.file),
        h('p', { class: 'meta', testid: 'file-meta' },
          h('span', { class: 'badge', testid: 'file-version' }, `Version ${version.version}`),
          ` ${authorText(version)} · ${fmtDate(version.created_at)} · ${plural(version.chars, 'character')}`)),
      h('div', { class: 'actions', role: 'group', 'aria-label': `What to do with ${state.file}` },
        button('Edit', () => setMode('edit'), { testid: 'edit', 'aria-pressed': String(mode === 'edit') }),
        button('History', () => setMode('history'), { testid: 'history', 'aria-pressed': String(mode === 'history') }),
        button('Reset…', () => resetFile(), { testid: 'reset', class: 'btn btn-quiet' })));
    const body = h('div', { class: 'file-body' });
    fill(view, head, body);
    if (mode === 'edit') renderEditor(body, version);
    else if (mode === 'history') renderHistory(body);
    else body.appendChild(markdown(version.html, 'file-content'));
  }

  function markdown(html, testid) {
    const box = h('div', { class: 'markdown', testid });
    box.innerHTML = html; // rendered by the server; raw HTML in the text is escaped there
    return box;
  }

  function renderEditor(body, version) {
    const max = Number(state.me.file_max_chars) || 0;
    const editor = h('textarea', {
      id: 'editor', testid: 'editor', rows: '18', spellcheck: 'true', 'aria-describedby': 'char-count editor-help',
    });
    editor.value = version.content;
    editor.defaultValue = version.content;
    const count = h('span', { id: 'char-count', class: 'count', testid: 'char-count' });
    const update = () => {
      const n = chars(editor.value);
      count.textContent = max ? `${fmtInt(n)} / ${fmtInt(max)} characters` : plural(n, 'character');
      count.classList.toggle('over', Boolean(max) && n > max);
    };
    editor.addEventListener('input', update);
    editor.addEventListener('keydown', (event) => {
      if ((event.ctrlKey || event.metaKey) && event.key === 's') {
        event.preventDefault();
        save.click();
      } else if (event.key === 'Escape') {
        event.preventDefault();
        cancel.click();
      }
    });
    update();
    const save = button('Save', () => saveFile(editor, version.version, save), { class: 'btn btn-primary', testid: 'save' });
    const cancel = button('Cancel', () => setMode('view'), { testid: 'cancel' });
    fill(body, 
      h('label', { for: 'editor', class: 'editor-label' }, `Edit ${state.file} (Markdown)`),
      h('p', { class: 'hint', id: 'editor-help' },
        `Your change is saved as a new version after version ${version.version}; the history keeps every earlier one.`),
      editor,
      h('div', { class: 'editor-foot' }, count, h('div', { class: 'actions' }, cancel, save)),
      state.draft === null ? null : h('details', { class: 'draft', open: true, testid: 'draft' },
        h('summary', null, 'Your text from before (not saved)'),
        h('p', { class: 'hint' }, 'The file changed while you edited it; copy what you need from your text below.'),
        h('textarea', { readOnly: true, rows: '8', 'aria-label': 'Your unsaved text', value: state.draft,
          'data-unsaved': '1' })));
    editor.focus();
  }

  async function saveFile(editor, baseVersion, trigger) {
    clearAlert();
    trigger.disabled = true;
    try {
      const saved = await api('PUT', filePath(state.file), { content: editor.value, version: baseVersion });
      state.files[state.file] = saved;
      state.fileMode = 'view';
      state.draft = null;
      renderFiles();
      notify(saved.changed ? `Saved ${state.file} as version ${saved.version}.`
        : `Nothing changed: ${state.file} stays at version ${saved.version}.`);
    } catch (err) {
      showError(err);
      if (err instanceof ApiError && err.status === 409) conflict(editor);
    } finally {
      if (trigger.isConnected) trigger.disabled = false;
    }
  }

  function conflict(editor) {
    const foot = editor.parentElement.querySelector('.editor-foot .actions');
    if (!foot || foot.querySelector('[data-testid="reload"]')) return;
    foot.prepend(button('Load the current version', async (event) => {
      const draft = editor.value;
      await attempt(async () => {
        state.files[state.file] = await api('GET', filePath(state.file));
        state.draft = draft;
        renderFiles();
      }, event.currentTarget);
    }, { testid: 'reload', class: 'btn btn-quiet' }));
  }

  async function resetFile() {
    if (!leaveEditor()) return;  // (what is typed in the editor is in no version: asked about first)
    if (!window.confirm(`Reset ${state.file} to its starting template? The current text stays in the history.`)) return;
    await attempt(async () => {
      const saved = await api('POST', `${filePath(state.file)}/reset`);
      state.files[state.file] = saved;
      state.fileMode = 'view';
      renderFiles();
      notify(saved.changed ? `${state.file} is back to its template (version ${saved.version}).`
        : `${state.file} already is its template.`);
    });
  }

  let diffTimer = 0;

  async function renderHistory(body) {
    await section(body, 'the history', async (stale) => {
      const data = await api('GET', `${filePath(state.file)}/versions`);
      if (stale()) return;
      const versions = data.versions;
      const numbers = versions.map((v) => v.version);
      if (!numbers.includes(state.diff.to)) state.diff.to = numbers[0];
      if (!numbers.includes(state.diff.from)) state.diff.from = numbers[1] || numbers[0];
      const current = numbers[0];
      const diffArea = h('div', { class: 'diff-area', id: 'diff-area' });
      const preview = h('div', { class: 'preview', id: 'version-preview' });
      const radio = (kind, n) => h('input', {
        type: 'radio', name: `diff-${kind}`, value: String(n), checked: state.diff[kind] === n,
        testid: `${kind}-${n}`, 'aria-label': `Compare ${kind} version ${n}`,
        onchange: () => {  // (after a pause: arrow keys through the list pick a version at each step)
          state.diff[kind] = n;
          clearTimeout(diffTimer);
          diffTimer = setTimeout(() => showDiff(diffArea), 250);
        },
      });
      const list = table([
        { label: 'From', class: 'pick', cell: (v) => radio('from', v.version) },
        { label: 'To', class: 'pick', cell: (v) => radio('to', v.version) },
        { label: 'Version', class: 'num', cell: (v) => `${v.version}` },
        { label: 'Date', cell: (v) => fmtDate(v.created_at) },
        { label: 'By', cell: (v) => authorName(v.author) },
        { label: 'Reason', class: 'wrap', cell: (v) => [v.reason || '—', v.tier ? h('span', { class: 'muted' }, ` (${v.tier})`) : null] },
        { label: 'Size', class: 'num', cell: (v) => fmtInt(v.chars) },
        {
          label: 'Actions', class: 'row-actions', cell: (v) => [
            button('View', () => previewVersion(preview, v.version), { class: 'btn btn-small', testid: `view-${v.version}` }),
            v.version === current ? h('span', { class: 'muted current' }, 'current')
              : button('Revert…', (event) => revertTo(v.version, event.currentTarget),
                { class: 'btn btn-small', testid: `revert-${v.version}`, 'aria-label': `Revert to version ${v.version}` }),
          ],
        },
      ], versions, { class: 'versions', testid: 'versions', 'aria-label': `Versions of ${state.file}, newest first` });
      const older = data.total > versions.length
        ? h('p', { class: 'hint', testid: 'versions-more' }, `The newest ${fmtInt(versions.length)} of ${fmtInt(data.total)} versions.`) : null;
      fill(body, h('h3', null, `History of ${state.file}`),
        h('p', { class: 'hint' }, 'Choose two versions to compare (From and To), view one as it was, or go back to one.'),
        list, older, diffArea, preview);
      showDiff(diffArea);
    });
  }

  async function showDiff(area) {
    const { from, to } = state.diff;
    if (from === to) {
      fill(area, h('h3', null, `Version ${from}`),
        empty(from === state.diff.to && state.files[state.file].version === 1
          ? 'There is only one version so far: nothing to compare yet.' : 'Choose two different versions to compare.'));
      return;
    }
    await section(area, 'the comparison', async (stale) => {
      const data = await api('GET', `${filePath(state.file)}/diff?from=${from}&to=${to}`);
      if (stale()) return;
      fill(area, 
        h('div', { class: 'diff-head' }, h('h3', { testid: 'diff-title' }, `Changes from version ${from} to version ${to}`),
          h('p', { class: 'legend' }, h('span', { class: 'key key-delete' }, 'removed'),
            h('span', { class: 'key key-replace' }, 'changed'), h('span', { class: 'key key-insert' }, 'added'))),
        diffTable(data.rows, from, to));
    });
  }

  function diffTable(rows, from, to) {
    if (!rows.some((r) => r.op !== 'equal')) return empty('The two versions have the same text.');
    const near = rows.map(() => false);
    rows.forEach((r, i) => {
      if (r.op === 'equal') return;
      for (let k = Math.max(0, i - DIFF_CONTEXT); k <= Math.min(rows.length - 1, i + DIFF_CONTEXT); k++) near[k] = true;
    });
    const tbody = h('tbody');
    let i = 0;
    while (i < rows.length) {
      if (near[i]) {
        tbody.appendChild(diffRow(rows[i]));
        i++;
        continue;
      }
      const hidden = [];
      while (i < rows.length && !near[i]) hidden.push(rows[i++]);
      const fold = h('tr', { class: 'fold' });
      fold.appendChild(h('td', { colspan: '4' }, button(`Show ${plural(hidden.length, 'unchanged line')}`, () => {
        fold.replaceWith(...hidden.map(diffRow));
      }, { class: 'btn btn-link' })));
      tbody.appendChild(fold);
    }
    return h('div', { class: 'table-wrap' },
      h('table', { class: 'diff', testid: 'diff' },
        h('colgroup', null, h('col', { class: 'no' }), h('col', { class: 'side' }), h('col', { class: 'no' }),
          h('col', { class: 'side' })),
        h('thead', null, h('tr', null, h('th', { colspan: '2', scope: 'colgroup' }, `Version ${from}`),
          h('th', { colspan: '2', scope: 'colgroup' }, `Version ${to}`))),
        tbody));
  }

  const SIDE_LABEL = { delete: 'removed', insert: 'added', replace: 'changed' };

  function diffRow(row) {
    const side = (no, text, which) => [
      h('td', { class: 'no' }, no === null || no === undefined ? '' : String(no)),
      h('td', {
        class: `${which}${text === null || text === undefined ? ' blank' : ''}`,
        title: text === null || text === undefined || row.op === 'equal' ? null
          : `${which === 'left' ? 'old' : 'new'} line, ${SIDE_LABEL[row.op]}`,
      }, text === null || text === undefined || row.op === 'equal' ? null
        : h('span', { class: 'sr-only' }, `${which === 'left' ? 'old' : 'new'} line, ${SIDE_LABEL[row.op]}: `),
      text === null || text === undefined ? '' : text),
    ];
    return h('tr', { class: `op-${row.op}`, 'data-op': row.op }, side(row.left_no, row.left, 'left'),
      side(row.right_no, row.right, 'right'));
  }

  async function previewVersion(area, number) {
    await section(area, `version ${number}`, async (stale) => {
      const version = await api('GET', `${filePath(state.file)}/versions/${number}`);
      if (stale()) return;
      fill(area, h('div', { class: 'preview-head' },
        h('h3', null, `Version ${number} as it was`),
        button('Close', () => fill(area), { class: 'btn btn-small btn-quiet' })),
      h('p', { class: 'meta' }, `${authorText(version)} · ${fmtDate(version.created_at)} · ${version.reason || ''}`),
      markdown(version.html, 'version-content'));
      area.scrollIntoView({ block: 'nearest', behavior: 'smooth' });
    });
  }

  async function revertTo(number, trigger) {
    if (!window.confirm(`Go back to version ${number} of ${state.file}? Its text is saved as a new version; nothing is lost.`)) {
      return;
    }
    await attempt(async () => {
      const saved = await api('POST', `${filePath(state.file)}/revert`, { version: number });
      state.files[state.file] = saved;
      state.fileMode = 'view';
      state.diff = { from: 0, to: 0 };
      renderFiles();
      notify(saved.changed ? `${state.file} is back to the text of version ${number}, saved as version ${saved.version}.`
        : `${state.file} already has the text of version ${number}.`);
    }, trigger);
  }

  // -- Memory items -----------------------------------------------------------------------------

  function showItems() {
    const panel = $('panel-items');
    const f = state.items;
    const query = h('input', {
      type: 'search', id: 'items-query', testid: 'items-query', value: f.query, placeholder: 'words or meaning',
      autocomplete: 'off',
    });
    const category = select([['', 'any'], ...CATEGORIES.map((c) => [c, c.replace(/_/g, ' ')])], f.category,
      { id: 'items-category', testid: 'items-category' });
    const pinned = select([['', 'any'], ['true', 'pinned'], ['false', 'not pinned']], f.pinned,
      { id: 'items-pinned', testid: 'items-pinned' });
    const scope = select([['', 'any'], ['private', 'private'], ['shared', 'shared']], f.scope,
      { id: 'items-scope', testid: 'items-scope' });
    const archived = select([['false', 'kept'], ['true', 'forgotten or replaced']], f.archived,
      { id: 'items-archived', testid: 'items-archived' });
    const results = h('div', { id: 'items-results', class: 'items-results' });
    const apply = () => {
      Object.assign(f, {
        query: query.value.trim(), category: category.value, pinned: pinned.value, scope: scope.value,
        archived: archived.value, page: 1,
      });
      loadItems(results);
    };
    let typing = 0;
    query.addEventListener('input', () => {
      clearTimeout(typing);
      typing = setTimeout(apply, 400);
    });
    for (const control of [category, pinned, scope, archived]) control.addEventListener('change', apply);
    const form = h('form', {
      class: 'filters', role: 'search', 'aria-label': 'Find memory items',
      onsubmit: (event) => {
        event.preventDefault();
        clearTimeout(typing);
        apply();
      },
    }, field('Search', query), field('Category', category), field('Pinned', pinned), field('Scope', scope),
    field('Show', archived), h('div', { class: 'field field-button' }, h('button', { type: 'submit', class: 'btn btn-primary' }, 'Search')));
    fill(panel, 
      h('div', { class: 'panel-head' }, h('h2', null, `What ${state.persona} remembers about you`),
        h('p', { class: 'hint' }, 'Single facts the persona can recall. Pin what should always be in mind; private items ',
          'only come up in your DMs, shared ones in group channels too. Forgotten items can be restored.')),
      form, results);
    loadItems(results);
  }

  async function loadItems(results) {
    const f = state.items;
    const q = new URLSearchParams({ persona: state.persona, page: String(f.page) });
    for (const key of ['query', 'category', 'pinned', 'scope', 'archived']) if (f[key]) q.set(key, f[key]);
    await section(results, 'your memory items', async (stale) => {
      const data = await api('GET', `/api/me/items?${q}`);
      if (stale()) return;
      renderItems(results, data);
    }, true);
  }

  function renderItems(results, data) {
    const f = state.items;
    const items = data.items || [];
    if (!items.length && f.page > 1 && (data.total || 0) > 0) {  // (the last page's items went: the one before)
      f.page = Math.max(1, Math.min(f.page - 1, data.pages || 1));
      loadItems(results);
      return;
    }
    const editing = items.find((it) => it.id === state.editingItem && !locked(it));
    const orphan = state.editingItem && !editing && state.itemDraft !== null ? unsavedCorrection() : null;
    const summary = h('p', { class: 'summary', testid: 'items-summary', tabindex: '-1' },
      `${plural(data.total ?? items.length, f.archived === 'true' ? 'forgotten or replaced item' : 'item')}`,
      // (a search ranks by words and meaning: it filters none)
      f.query ? `, the best for “${f.query}” first` : '', data.pages > 1 ? ` · page ${data.page} of ${data.pages}` : '');
    if (!items.length) {
      fill(results, summary, orphan, empty(f.query || f.category || f.pinned || f.scope
        ? 'No items match these filters.'
        : f.archived === 'true' ? 'Nothing forgotten or replaced.' : `${state.persona} has no memory items about you yet.`));
      return;
    }
    const reload = () => loadItems(results);
    const rows = table([
      { label: '#', class: 'num', cell: (it) => `#${it.id}` },
      { label: 'Memory', class: 'wrap content', cell: (it) => itemContent(it, reload) },
      { label: 'Category', cell: (it) => chip((it.category || '').replace(/_/g, ' ')) },
      { label: 'Importance', class: 'num', cell: (it) => h('span', { title: `importance ${it.importance} of 10` }, `${it.importance}`) },
      {
        label: 'Scope', cell: (it) => {
          const other = it.scope === 'private' ? 'shared' : 'private';
          return button(it.scope, (event) => patchItem(it, { scope: other }, `#${it.id} is ${other} now.`, reload,
            event.currentTarget), {
            class: `btn btn-small toggle scope-${it.scope}`, testid: `scope-${it.id}`, disabled: locked(it),
            'aria-label': `#${it.id} is ${it.scope}; make it ${other}`,
            title: it.scope === 'private' ? 'Only in your DMs: click to share in group channels too'
              : 'Also in group channels: click to keep it to your DMs',
          });
        },
      },
      {
        label: 'Pinned', cell: (it) => button(it.pinned ? '★ pinned' : '☆ pin', (event) => patchItem(it,
          { pinned: !it.pinned }, it.pinned ? `#${it.id} is not pinned any more.` : `#${it.id} is pinned.`, reload,
          event.currentTarget), {
          class: `btn btn-small toggle${it.pinned ? ' on' : ''}`, testid: `pin-${it.id}`, 'aria-pressed': String(Boolean(it.pinned)),
          'aria-label': `Pin #${it.id}`, disabled: locked(it),
        }),
      },
      { label: 'Added', cell: (it) => fmtDate(it.created_at) },
      {
        label: 'Actions', class: 'row-actions', cell: (it) => (it.superseded_by && !it.archived_at
          ? h('span', { class: 'muted' }, `see #${it.superseded_by}`) : it.archived_at || expired(it)
          ? button('Restore', (event) => itemAction(it, 'restore', `#${it.id} is back.`, reload, event.currentTarget),
            { class: 'btn btn-small', testid: `restore-${it.id}`, 'aria-label': `Restore #${it.id}` })
          : [
            button('Edit', () => {
              if (state.editingItem === it.id && $('item-editor')) {  // (already open: the typed text stays)
                $('item-editor').focus();
                return;
              }
              if (!leaveEditor()) return;  // (another item's correction unsaved)
              state.editingItem = it.id;
              state.itemDraft = null;
              state.focusItemEditor = true;
              renderItems(results, data);
            }, { class: 'btn btn-small', testid: `edit-${it.id}`, 'aria-label': `Edit #${it.id}` }),
            button('Forget', (event) => itemAction(it, 'forget', `Forgot #${it.id}; “forgotten or replaced” under Show brings it back.`,
              reload, event.currentTarget), { class: 'btn btn-small btn-danger-quiet', testid: `forget-${it.id}`,
              'aria-label': `Forget #${it.id}` }),
          ]),
      },
    ], items, {
      class: 'items', testid: 'items-table', 'aria-label': 'Memory items',
      rowAttrs: (it) => ({ testid: `item-${it.id}`, class: it.archived_at || it.superseded_by ? 'dim' : null }),
    });
    const pager = data.pages > 1 ? h('nav', { class: 'pager', 'aria-label': 'Pages' },
      // (from the page shown: a second click while the next page loads asks for the same page again)
      // (a search ranks by relevance: its pages are not newer and older)
      button(f.query ? '← Better matches' : '← Newer', () => { f.page = Math.max(1, data.page - 1); reload(); },
        { disabled: data.page <= 1, testid: 'items-prev' }),
      h('span', null, `Page ${data.page} of ${data.pages}`),
      button(f.query ? 'Weaker matches →' : 'Older →', () => { f.page = Math.min(data.pages, data.page + 1); reload(); },
        { disabled: data.page >= data.pages, testid: 'items-next' })) : null;
    fill(results, summary, orphan, rows, pager);
    const editor = $('item-editor');
    if (editor && state.focusItemEditor) editor.focus();  // (only when opened: a reload leaves the keyboard be)
    state.focusItemEditor = false;
  }

  /** A correction whose item is not in the list any more (forgotten or corrected meanwhile, or on another page):
   * its text stays on the page to copy until the person lets it go. */
  function unsavedCorrection() {
    const text = h('textarea', { readOnly: true, rows: '3', value: state.itemDraft, testid: 'unsaved-correction',
      'aria-label': `Your correction of #${state.editingItem} (not saved)` });
    text.dataset.unsaved = '1';
    const box = h('div', { class: 'card draft', testid: 'unsaved-correction-box' },
      h('p', null, `Your correction of #${state.editingItem} is not saved: the item is not in this list any more `,
        '(forgotten or corrected meanwhile, or on another page). Copy what you need:'),
      text, h('div', { class: 'actions' }, button('Let it go', () => {
        state.editingItem = 0;
        state.itemDraft = null;
        box.remove();
        refocus(null);
      }, { class: 'btn btn-small', testid: 'drop-correction' })));
    return box;
  }

  /** A forgotten item, an expired one, or one replaced by a correction, is not changed any more (restore it
   * first; a replaced one is changed through its correction). */
  function locked(it) {
    return Boolean(it.archived_at || it.superseded_by || expired(it));
  }

  /** Past its time and not archived yet (the daily upkeep does that): restorable, as a forgotten one is. */
  function expired(it) {
    return Boolean(!it.archived_at && !it.superseded_by && it.expires_at && toMs(it.expires_at) <= Date.now());
  }

  function itemContent(it, reload) {
    if (state.editingItem === it.id && !locked(it)) return itemEditor(it, reload);
    const notes = [];
    if (it.source === 'model') notes.push(`noted by ${it.persona || state.persona}`);
    else if (it.source === 'user') notes.push('told by you');
    if (it.supersedes) notes.push(`corrects #${it.supersedes}`);
    if (it.superseded_by) notes.push(`replaced by #${it.superseded_by}`);
    if (it.archived_at) notes.push(`forgotten ${fmtDate(it.archived_at)}${it.archive_reason ? `: ${it.archive_reason}` : ''}`);
    else if (it.expires_at && !it.superseded_by) {  // (a time-bound fact: "until Friday")
      notes.push(`${toMs(it.expires_at) <= Date.now() ? 'expired' : 'kept until'} ${fmtDate(it.expires_at)}`);
    }
    if (typeof it.score === 'number') notes.push(`match ${it.score.toFixed(2)}`);
    return [h('span', { class: 'item-text' }, it.content), notes.length ? h('span', { class: 'item-notes' }, notes.join(' · ')) : null];
  }

  /** The correction of an item: Escape cancels (asking first when something was typed), Ctrl+Enter saves. A
   * correction the bot refuses stays in the editor with the reason above it; so does one typed while the
   * list reloads. */
  function itemEditor(it, reload) {
    const editor = h('textarea', { id: 'item-editor', testid: 'item-editor', rows: '3', value: it.content,
      'aria-label': `Correct #${it.id}`, 'aria-describedby': 'item-editor-help' });
    if (state.itemDraft !== null) editor.value = state.itemDraft;
    editor.addEventListener('input', () => { state.itemDraft = editor.value; });
    const done = () => {
      state.editingItem = 0;
      state.itemDraft = null;
    };
    const cancel = () => {
      if (editor.value !== it.content && !window.confirm(`Discard your correction of #${it.id}?`)) return;
      done();
      reload().then(() => refocus(`edit-${it.id}`));
    };
    const save = button('Save correction', async () => {
      const saved = await attempt(() => api('PATCH', `/api/me/items/${enc(it.id)}`, { content: editor.value }), save);
      if (saved === undefined) {  // (refused: the text stays where it was typed)
        if (editor.isConnected) editor.focus();
        return;
      }
      done();
      notify(saved.id === it.id ? `#${it.id} is unchanged.` : `Corrected #${it.id}: the correction is #${saved.id}.`);
      await reload();
      refocus(`edit-${saved.id}`);
    }, { class: 'btn btn-small btn-primary', testid: 'item-save' });
    editor.addEventListener('keydown', (event) => {
      if (event.key === 'Escape') {
        event.preventDefault();
        cancel();
      } else if (event.key === 'Enter' && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        save.click();
      }
    });
    return h('div', { class: 'item-edit' }, editor,
      h('p', { class: 'hint', id: 'item-editor-help' }, 'Ctrl+Enter saves, Escape cancels.'),
      h('div', { class: 'actions' }, button('Cancel', cancel, { class: 'btn btn-small', testid: 'item-cancel' }), save));
  }

  /** After a list reloads, the keyboard goes back to the control it was on (or to the list). */
  function refocus(testid) {
    const target = testid ? document.querySelector(`[data-testid="${CSS.escape(testid)}"]`) : null;
    const fallback = $('items-results') && $('items-results').querySelector('[data-testid="items-summary"]');
    const el = target && !target.disabled ? target : fallback;
    if (el) el.focus();
  }

  function patchItem(it, change, message, reload, trigger) {
    return itemRequest(() => api('PATCH', `/api/me/items/${enc(it.id)}`, change), message, reload, trigger);
  }

  function itemAction(it, action, message, reload, trigger) {
    return itemRequest(() => api('POST', `/api/me/items/${enc(it.id)}/${action}`), message, reload, trigger);
  }

  /** A change of an item: its word on success, the list reloaded, the keyboard back on the control used. */
  async function itemRequest(request, message, reload, trigger) {
    const id = trigger && trigger.dataset.testid;
    const done = await attempt(request, trigger);
    if (done !== undefined) notify(message);
    else if ($('app').hidden) return;  // (the session ended)
    await reload();
    refocus(id);
  }

  // -- Activity ---------------------------------------------------------------------------------

  async function showActivity() {
    const panel = $('panel-activity');
    await section(panel, 'the activity', async (stale) => {
      const data = await api('GET', `${personaPath()}/activity`);
      if (stale()) return;
      const runs = data.runs || [];
      const budgets = data.budgets || {};
      fill(panel, 
        h('div', { class: 'panel-head' }, h('h2', null, `How ${state.persona}'s files about you grew`),
          h('p', { class: 'hint' }, 'Each line is a file\'s size; a marker shows when the persona updated its files.')),
        h('div', { class: 'card' }, h('div', { class: 'chart-scroll' }, sizeChart(data.files || {}, runs)), chartLegend()),
        h('div', { class: 'card' }, h('h3', null, 'Update runs'), runs.length ? table([
          { label: 'Started', cell: (r) => fmtDate(r.started_at) },
          { label: 'Tier', cell: (r) => r.tier || '—' },
          { label: 'Status', cell: (r) => chip(r.status, r.status) },
          { label: 'Took', class: 'num', cell: (r) => fmtDuration(r.duration_ms) },
          { label: 'Tokens in', class: 'num', cell: (r) => fmtInt(r.input_tokens) },
          { label: 'Tokens out', class: 'num', cell: (r) => fmtInt(r.output_tokens) },
          { label: 'Files written', cell: (r) => (Array.isArray(r.files_written) ? r.files_written.join(', ') || '—' : fmtValue(r.files_written)) },
          { label: 'Reason', class: 'wrap', cell: (r) => [r.reason || '', r.error ? h('span', { class: 'error-text' }, ` ${r.error}`) : null] },
        ], runs, { class: 'runs', testid: 'runs' }) : empty('No update runs yet.')),
        Object.keys(budgets).length ? h('div', { class: 'card' }, h('h3', null, 'What the persona reads'),
          h('dl', { class: 'facts' },
            budgets.history_tokens !== undefined ? [h('dt', null, 'Recent conversation'), h('dd', null, `up to ${fmtInt(budgets.history_tokens)} tokens`)] : null,
            budgets.summary_tokens !== undefined ? [h('dt', null, 'Summary of older talk'), h('dd', null, `up to ${fmtInt(budgets.summary_tokens)} tokens`)] : null,
            Object.entries(budgets).filter(([k]) => !['history_tokens', 'summary_tokens'].includes(k))
              .map(([k, v]) => [h('dt', null, k.replace(/_/g, ' ')), h('dd', null, fmtValue(v))]))) : null);
    });
  }

  function chartLegend() {
    return h('ul', { class: 'legend-list', 'aria-label': 'Legend' },
      state.me.files.map((name, i) => h('li', null, h('span', { class: `swatch series-${i}` }), name)),
      h('li', null, h('span', { class: 'swatch swatch-run' }), 'update run'));
  }

  function niceMax(value) {
    if (value <= 0) return 100;
    const power = 10 ** Math.floor(Math.log10(value));
    for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  function sizeChart(files, runs) {
    const W = 760;
    const H = 260;
    const m = { left: 56, right: 16, top: 14, bottom: 34 };
    const series = state.me.files.map((name) => ({
      name, points: (files[name] || []).map((p) => ({ ...p, t: toMs(p.created_at) })).filter((p) => !Number.isNaN(p.t)),
    }));
    const marks = runs.map((r) => ({ ...r, t: toMs(r.started_at) })).filter((r) => !Number.isNaN(r.t));
    const times = [...series.flatMap((x) => x.points.map((p) => p.t)), ...marks.map((r) => r.t)];
    if (!times.length) return empty('Nothing to draw yet.');
    const now = Date.now();
    let t0 = Math.min(...times);
    let t1 = Math.max(now, ...times);
    if (t1 - t0 < 3600e3) t0 = t1 - 3600e3;
    const pad = (t1 - t0) * 0.02;
    t0 -= pad;
    t1 += pad;
    const top = niceMax(Math.max(...series.flatMap((x) => x.points.map((p) => p.chars)), 0) * 1.1);
    const x = (t) => m.left + ((t - t0) / (t1 - t0)) * (W - m.left - m.right);
    const y = (v) => H - m.bottom - (v / top) * (H - m.top - m.bottom);
    const r2 = (v) => Math.round(v * 10) / 10;
    const grid = [];
    for (let k = 0; k <= 4; k++) {
      const v = (top / 4) * k;
      grid.push(s('line', { class: 'grid', x1: m.left, x2: W - m.right, y1: r2(y(v)), y2: r2(y(v)) }),
        s('text', { class: 'tick', x: m.left - 8, y: r2(y(v)) + 4, 'text-anchor': 'end' }, fmtInt(v)));
    }
    const spanDays = (t1 - t0) / 864e5;
    for (let k = 0; k <= 4; k++) {
      const t = t0 + ((t1 - t0) / 4) * k;
      const label = spanDays < 2 ? timeOnly.format(new Date(t)) : dayOnly.format(new Date(t));
      grid.push(s('text', { class: 'tick', x: r2(x(t)), y: H - m.bottom + 20, 'text-anchor': k === 0 ? 'start' : k === 4 ? 'end' : 'middle' }, label));
    }
    const runMarks = marks.map((r) => s('g', { class: `run run-${r.status || 'unknown'}` },
      s('title', null, `Update run #${r.id} (${r.tier || 'update'}, ${r.status}) ${fmtDate(r.started_at)}`),
      s('line', { x1: r2(x(r.t)), x2: r2(x(r.t)), y1: m.top, y2: H - m.bottom }),
      s('path', { d: `M${r2(x(r.t))} ${H - m.bottom} l-5 8 h10 z` })));
    const lines = series.map((serie, i) => {
      const pts = serie.points;
      if (!pts.length) return null;
      let d = `M${r2(x(pts[0].t))} ${r2(y(pts[0].chars))}`;
      for (const p of pts.slice(1)) d += ` H${r2(x(p.t))} V${r2(y(p.chars))}`;
      d += ` H${r2(x(now))}`;
      return s('g', { class: `series series-${i}` },
        s('path', { d, fill: 'none' }),
        pts.map((p) => s('circle', { cx: r2(x(p.t)), cy: r2(y(p.chars)), r: 3.5 },
          s('title', null, `${serie.name} version ${p.version}: ${plural(p.chars, 'character')}, by ${authorName(p.author)}, ${fmtDate(p.created_at)}`))));
    });
    return s('svg', {
      class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-labelledby': 'chart-title', testid: 'activity-chart',
      preserveAspectRatio: 'xMidYMid meet',
    }, s('title', { id: 'chart-title' }, 'Size of each file (characters) over time, with the update runs'),
    s('line', { class: 'axis', x1: m.left, x2: W - m.right, y1: H - m.bottom, y2: H - m.bottom }),
    grid, runMarks, lines);
  }

  // -- Export & delete --------------------------------------------------------------------------

  function showExport() {
    const panel = $('panel-export');
    const phrase = h('input', { type: 'text', id: 'forget-phrase', testid: 'forget-phrase', autocomplete: 'off', spellcheck: 'false' });
    const confirmButton = button('Delete everything about me', () => forgetMe(phrase, confirmButton),
      { class: 'btn btn-danger', testid: 'forget-me-confirm', disabled: true });
    phrase.addEventListener('input', () => {
      confirmButton.disabled = saidPhrase(phrase) !== 'forget me';
    });
    phrase.addEventListener('keydown', (event) => {
      if (event.key === 'Enter' && !confirmButton.disabled) confirmButton.click();
      else if (event.key === 'Escape') cancelStep.click();
    });
    const cancelStep = button('Cancel', () => {
      confirmStep.hidden = true;
      start.hidden = false;
      phrase.value = '';
      confirmButton.disabled = true;
      start.focus();
    }, { testid: 'forget-me-cancel' });
    const confirmStep = h('div', { class: 'confirm-step', hidden: true, testid: 'forget-me-step' },
      field('Type “forget me” to confirm', phrase, 'This cannot be undone.'),
      h('div', { class: 'actions' }, cancelStep, confirmButton));
    const start = button('Delete everything about me…', () => {
      start.hidden = true;
      confirmStep.hidden = false;
      phrase.focus();
    }, { class: 'btn btn-danger-quiet', testid: 'forget-me-start' });
    fill(panel, 
      h('div', { class: 'card' }, h('h2', null, 'Download your data'),
        h('p', null, 'One zip file with everything the bot keeps about you, for every persona: your files and all their ',
          'versions, your memory items, and your messages. It is readable (Markdown) and also machine-readable (JSON), ',
          'and ', h('code', null, '!memory import'), ' can take it back.'),
        // (a button, not a link to the zip: a link opened in a new tab or saved from its menu is a request without
        // this page's user, and after someone else's login in another tab it would be their zip)
        button('Download (zip)', (event) => downloadExport(event.currentTarget),
          { class: 'btn btn-primary', testid: 'export-link' })),
      h('div', { class: 'card danger-zone' }, h('h2', null, 'Delete everything about you'),
        h('p', null, 'Deletes your files, memory items, messages and summaries with every persona, and logs you out. ',
          'If you talk to the bot again it starts from nothing.'),
        start, confirmStep));
  }

  /** The export as a download, asked for as the page's user (someone else's login in another tab ends the page
   * instead); a refusal (too many at once, the limit, an ended session) is said in words (a plain link left the
   * browser with a failed download and the page silent). */
  async function downloadExport(trigger) {
    if (trigger.getAttribute('aria-disabled') === 'true') return;
    trigger.setAttribute('aria-disabled', 'true');
    notify('Preparing your export… (a long history takes a moment)');
    try {
      await attempt(async () => {
        const response = await request('GET', '/api/me/export');
        const named = /filename="?([^";]+)"?/.exec(response.headers.get('Content-Disposition') || '');
        const url = URL.createObjectURL(await response.blob());
        const save = h('a', { href: url, download: named ? named[1] : 'cortex-bot-export.zip', hidden: true });
        document.body.appendChild(save);
        save.click();
        save.remove();
        setTimeout(() => URL.revokeObjectURL(url), 60_000);
        notify('Your export is downloading.');
      });
    } finally {
      trigger.removeAttribute('aria-disabled');
    }
  }

  /** The confirmation as typed, without the quotes the label shows it in (pasted with it) or doubled spaces. */
  function saidPhrase(phrase) {
    return phrase.value.replace(/["“”„«»'‘’]/g, '').trim().replace(/\s+/g, ' ').toLowerCase();
  }

  async function forgetMe(phrase, trigger) {
    await attempt(async () => {
      const result = await api('POST', '/api/me/forget-me', { confirm: saidPhrase(phrase) });
      const paused = (result && result.still_incognito) || [];
      ended('Everything about you is deleted', ['The bot keeps nothing about you any more, and you are logged out. ',
        'If you talk to it again, it starts over.',
        ...(paused.length ? [' You are still incognito with ' + paused.join(', ') + ': what you say there is ',
          'deleted when you send !memory resume.'] : [])]);
    }, trigger);
  }

  // -- Admin ------------------------------------------------------------------------------------

  const ADMIN_SECTIONS = [
    { id: 'personas', label: 'Personas', bot: true, show: adminPersonas },
    { id: 'guidelines', label: 'Server guidelines', bot: false, show: adminGuidelines },
    { id: 'rules', label: 'Rules', bot: true, show: adminRules },
    { id: 'settings', label: 'Settings', bot: false, show: adminSettings },
    { id: 'spending', label: 'Token spending', bot: true, show: adminSpending },
    { id: 'jobs', label: 'Job queue', bot: true, show: adminJobs },
    { id: 'users', label: 'Users', bot: true, show: adminUsers },
  ];
  const BOT_WIDE = '*';

  async function showAdmin() {
    const panel = $('panel-admin');
    if (!state.overview) {
      try {
        state.overview = await api('GET', '/api/admin/overview');
      } catch (err) {
        showError(err);
      }
    }
    const overview = state.overview || {
      is_bot_admin: state.me.is_bot_admin, servers: state.me.admin_servers || [],
      personas: (state.me.personas || []).map((p) => p.name),
    };
    const allowed = ADMIN_SECTIONS.filter((x) => overview.is_bot_admin || !x.bot);
    const current = allowed.find((x) => x.id === state.adminSection) || allowed[0];
    state.adminSection = current.id;
    const content = h('div', { class: 'admin-content', id: 'admin-content', testid: `admin-${current.id}` });
    fill(panel, h('div', { class: 'admin-layout' },
      h('nav', { class: 'admin-nav', 'aria-label': 'Admin sections' },
        h('p', { class: 'admin-role' }, overview.is_bot_admin ? 'Bot admin'
          : `Admin of ${plural((overview.servers || []).length, 'server')}`),
        allowed.map((x) => h('button', {
          type: 'button', class: 'admin-pick', testid: `admin-nav-${x.id}`, 'aria-current': x === current ? 'page' : null,
          onclick: () => go('admin', x.id),
        }, x.label))),
      content));
    current.show(content, overview);
  }

  function personaNames(overview) {
    return (overview.personas || []).map((p) => (typeof p === 'string' ? p : p.name));
  }

  function adminHead(title, hint) {
    return h('div', { class: 'panel-head' }, h('h2', null, title), hint ? h('p', { class: 'hint' }, hint) : null);
  }

  /** Runs a change, then (when it worked) says so and reloads. */
  async function change(method, path, body, message, reload, trigger) {
    let answer = null;
    const done = await attempt(async () => {
      answer = await api(method, path, body);
      return true;
    }, trigger);
    if (done) {
      notify(typeof message === 'function' ? message(answer || {}) : message);
      const saved = trigger && trigger.closest ? trigger.closest('.text-editor') : null;
      for (const area of saved ? saved.querySelectorAll('textarea') : []) area.defaultValue = area.value;
      // The view is drawn again from the server: text typed in another editor would go with it unasked.
      if (!unsavedTexts().length || window.confirm('Saved. Show the new state now? What you typed in the other '
        + 'editors is not saved yet and would be lost (Cancel keeps it: save it, then reload).')) reload();
    }
    return Boolean(done);
  }

  /** A text's length as the server counts it (characters, not UTF-16 units: an emoji is one, not two). */
  function chars(text) {
    return [...text].length;
  }

  function historyList(entries, current, onRevert, what) {
    if (!entries || entries.length < 2) return null;
    return h('details', { class: 'history' }, h('summary', null, `History (${plural(entries.length, 'version')})`),
      table([
        { label: 'Version', class: 'num', cell: (e) => String(e.version) },
        { label: 'Date', cell: (e) => fmtDate(e.created_at) },
        { label: 'By', cell: (e) => e.author || '—' },
        { label: 'Reason', class: 'wrap', cell: (e) => e.reason || '—' },
        { label: 'Size', class: 'num', cell: (e) => fmtInt(e.chars) },
        {
          label: '', class: 'row-actions', cell: (e) => (e.version === current ? h('span', { class: 'muted' }, 'current')
            : onRevert ? button('Revert…', (event) => onRevert(e.version, event.currentTarget),
              { class: 'btn btn-small', 'aria-label': `Revert ${what} to version ${e.version}` }) : ''),
        },
      ], entries, { class: 'history-table' }));
  }

  function textEditor(label, text, max, onSave, onCancel, testid) {
    const area = h('textarea', { rows: '8', value: text, testid: testid ? `${testid}-text` : null });
    const count = h('span', { class: 'count' });
    const update = () => {
      const n = chars(area.value);
      count.textContent = max ? `${fmtInt(n)} / ${fmtInt(max)} characters` : plural(n, 'character');
      count.classList.toggle('over', Boolean(max) && n > max);
    };
    area.addEventListener('input', update);
    update();
    const save = button('Save', () => onSave(area.value, save), { class: 'btn btn-primary', testid: testid ? `${testid}-save` : null });
    return h('div', { class: 'text-editor' }, field(label, area),
      h('div', { class: 'editor-foot' }, count, h('div', { class: 'actions' },
        onCancel ? button('Cancel', onCancel) : null, save)));
  }

  function adminPersonas(content) {
    section(content, 'the personas', async (stale) => {
      const data = await api('GET', '/api/admin/personas');
      if (stale()) return;
      const reload = () => adminPersonas(content);
      fill(content, adminHead('Personas', 'Each persona\'s own text, section by section, as every reply reads it. '
        + 'A save is a new version; the history keeps the old ones.'),
      (data.personas || []).map((p) => h('div', { class: 'card persona-card', testid: `persona-${p.name}` },
        h('h3', null, p.name, h('span', { class: 'muted' }, [p.language, p.source].filter(Boolean).map((x) => ` · ${x}`).join(''))),
        (p.sections || []).length ? p.sections.map((sec) => personaSection(p, sec, data.max_chars, reload))
          : empty('No sections of its own yet: it speaks from its configured description.'),
        addSection(p, data.known_sections || [], data.max_chars, reload))));
    });
  }

  function sectionLabel(name) {
    const words = String(name).replace(/_/g, ' ');
    return words.charAt(0).toUpperCase() + words.slice(1);
  }

  function addSection(persona, known, max, reload) {
    const have = new Set((persona.sections || []).map((x) => x.name));
    const missing = known.filter((name) => !have.has(name));
    const OWN = '';
    const which = select([...missing.map((name) => [name, sectionLabel(name)]), [OWN, 'A section of your own…']],
      missing.length ? missing[0] : OWN, { testid: `add-section-${persona.name}` });
    const own = h('input', {
      type: 'text', autocomplete: 'off', maxlength: 40, pattern: '[A-Za-z0-9_ -]{1,40}', placeholder: 'e.g. backstory',
      testid: `new-section-${persona.name}-name`,
    });
    const ownField = field('Name', own, 'One word (letters, digits, _), not close to a standard name.');
    const showOwn = () => { ownField.hidden = which.value !== OWN; };
    which.addEventListener('change', showOwn);
    showOwn();
    const name = () => (which.value === OWN ? own.value.trim() : which.value);
    return h('details', { class: 'add-section' }, h('summary', null, 'Add a section'),
      h('div', { class: 'section-body' }, field('Section', which), ownField,
        textEditor('Text', '', max, (text, trigger) => {
          if (!name()) {
            showError(new Error('Give the new section a name.'));
            own.focus();
            return;
          }
          change('PUT', `/api/admin/personas/${enc(persona.name)}/sections/${enc(name())}`, { text, version: 0 },
            `Added ${sectionLabel(name())} to ${persona.name}.`, reload, trigger);
        }, null, `new-section-${persona.name}`)));
  }

  function personaSection(persona, sec, max, reload) {
    const path = `/api/admin/personas/${enc(persona.name)}/sections/${enc(sec.name)}`;
    const body = h('div', { class: 'section-body' });
    const show = () => fill(body, 
      sec.text ? h('pre', { class: 'text-block' }, sec.text) : empty('(empty)'),
      h('div', { class: 'actions' }, button('Edit', () => fill(body, 
        textEditor(`${sec.title || sec.name} of ${persona.name}`, sec.text || '', max,
          (text, trigger) => change('PUT', path, { text, version: sec.version }, `Saved ${persona.name}'s ${sec.title || sec.name}.`, reload, trigger),
          show)), { class: 'btn btn-small', 'aria-label': `Edit ${persona.name}'s ${sec.title || sec.name}` })),
      historyList(sec.history, sec.version, (version, trigger) => {
        if (!window.confirm(`Go back to version ${version} of ${persona.name}'s ${sec.title || sec.name}?`)) return;
        change('POST', `${path}/revert`, { version }, `${sec.title || sec.name} is back to version ${version}.`, reload, trigger);
      }, `${persona.name}'s ${sec.title || sec.name}`));
    show();
    return h('details', { class: 'persona-section' },
      h('summary', null, h('strong', null, sec.title || sectionLabel(sec.name)),
        h('span', { class: 'muted' }, sec.version ? ` v${sec.version}` : ''),
        h('span', { class: 'snippet' }, (sec.text || '').replace(/\s+/g, ' ').slice(0, 120))),
      body);
  }

  function adminGuidelines(content, overview) {
    const servers = (overview.servers || []).slice();
    if (overview.is_bot_admin) servers.unshift({ key: BOT_WIDE, name: 'Every server (the default)' });
    if (!servers.length) {
      fill(content, adminHead('Server guidelines'), empty('There is no server where you are an admin.'));
      return;
    }
    if (!servers.some((x) => x.key === state.guidelinesServer)) state.guidelinesServer = servers[0].key;
    const picker = select(servers.map((x) => [x.key, x.name && x.name !== x.key ? `${x.name} (${x.key})` : x.key]),
      state.guidelinesServer, { testid: 'guidelines-server' });
    const area = h('div');
    picker.addEventListener('change', () => {
      if (!leaveEditor()) {  // (what is typed for this server is asked about before another's text replaces it)
        picker.value = state.guidelinesServer;
        return;
      }
      state.guidelinesServer = picker.value;
      load();
    });
    const load = () => section(area, 'the guidelines', async (stale) => {
      const path = `/api/admin/servers/${enc(state.guidelinesServer)}/guidelines`;
      const data = await api('GET', path);
      if (stale()) return;
      fill(area, h('div', { class: 'card' },
        h('p', { class: 'meta' }, data.version ? `Version ${data.version}` : 'Not set yet'),
        textEditor('Guidelines', data.text || '', data.max_chars,
          (text, trigger) => change('PUT', path, { text, version: data.version }, 'Saved the guidelines.', load, trigger), null, 'guidelines'),
        historyList(data.history, data.version, (version, trigger) => {
          if (!window.confirm(`Go back to version ${version} of these guidelines?`)) return;
          change('POST', `${path}/revert`, { version }, `The guidelines are back to version ${version}.`, load, trigger);
        }, 'the guidelines')));
    });
    fill(content, adminHead('Server guidelines', 'What every persona follows on a server: tone, topics, limits.'),
      h('div', { class: 'bar' }, field('Server', picker)), area);
    load();
  }

  function adminRules(content) {
    section(content, 'the rules', async (stale) => {
      const data = await api('GET', '/api/admin/rules');
      if (stale()) return;
      const reload = () => adminRules(content);
      const rules = (data.rules || []).slice().sort((a, b) => (a.position ?? 0) - (b.position ?? 0));
      const name = h('input', { type: 'text', autocomplete: 'off', pattern: '[A-Za-z0-9_-]{1,40}', placeholder: 'one-word-name' });
      const adder = h('details', { class: 'card add-rule' }, h('summary', null, 'Add a rule'),
        field('Name', name, 'One word: letters, digits, - or _.'),
        textEditor('Text', '', data.max_chars, (text, trigger) => change('POST', '/api/admin/rules',
          { name: name.value.trim(), text }, `Added rule ${name.value.trim()}.`, reload, trigger), null, 'new-rule'));
      fill(content, adminHead('Rules', 'Instructions every persona follows everywhere, in this order.'),
        rules.length ? rules.map((rule) => ruleCard(rule, data.max_chars, reload)) : empty('No rules yet.'), adder);
    });
  }

  function ruleCard(rule, max, reload) {
    const path = `/api/admin/rules/${enc(rule.name)}`;
    const body = h('div', { class: 'section-body flush' });
    const show = () => fill(body, h('pre', { class: 'text-block' }, rule.text || ''),
      h('div', { class: 'actions' }, button('Edit', () => fill(body, textEditor(`Rule ${rule.name}`, rule.text || '', max,
        (text, trigger) => change('PUT', path, { text, version: rule.version }, `Saved rule ${rule.name}.`, reload, trigger), show)),
      { class: 'btn btn-small', 'aria-label': `Edit rule ${rule.name}` })),
      historyList(rule.history, rule.version, (version, trigger) => {
        if (!window.confirm(`Go back to version ${version} of rule ${rule.name}?`)) return;
        change('POST', `${path}/revert`, { version }, `Rule ${rule.name} is back to version ${version}.`, reload, trigger);
      }, `rule ${rule.name}`));
    show();
    const toggle = h('input', {
      type: 'checkbox', checked: Boolean(rule.enabled), testid: `rule-${rule.name}-enabled`,
      'aria-label': `Rule ${rule.name} enabled`,
      onchange: async (event) => {
        const box = event.target;
        if (!await change('PUT', path, { enabled: box.checked }, `Rule ${rule.name} is ${box.checked ? 'on' : 'off'}.`,
          reload, box)) box.checked = !box.checked;  // (refused: it shows the rule as it still is)
      },
    });
    return h('div', { class: `card rule${rule.enabled ? '' : ' dim'}`, testid: `rule-${rule.name}` },
      h('div', { class: 'rule-head' },
        h('h3', null, h('span', { class: 'muted' }, `${rule.position ?? ''}. `), rule.name,
          h('span', { class: 'muted' }, ` · version ${rule.version}`)),
        h('label', { class: 'switch' }, toggle, 'enabled')),
      body);
  }

  function adminSettings(content, overview) {
    const personas = personaNames(overview);
    const servers = overview.servers || [];
    const f = state.settingsFor;
    if (!personas.includes(f.persona)) f.persona = overview.default_persona || personas[0] || '';
    if (!overview.is_bot_admin && !servers.some((x) => x.key === f.server)) f.server = servers.length ? servers[0].key : '';
    const personaPick = select(personas.map((p) => [p, p]), f.persona, { testid: 'settings-persona' });
    const serverOptions = servers.map((x) => [x.key, x.name && x.name !== x.key ? `${x.name} (${x.key})` : x.key]);
    if (overview.is_bot_admin) serverOptions.unshift(['', 'everywhere (the persona\'s settings)']);
    const serverPick = select(serverOptions, f.server, { testid: 'settings-server' });
    const area = h('div');
    const load = () => section(area, 'the settings', async (stale) => {
      const q = new URLSearchParams({ persona: f.persona });
      if (f.server) q.set('server', f.server);
      const data = await api('GET', `/api/admin/settings?${q}`);
      if (stale()) return;
      const settings = data.settings || [];
      fill(area, 
        settings.length ? table([
          { label: 'Setting', cell: (x) => h('code', null, x.key) },
          { label: 'Value', cell: (x) => settingControl(x, load) },
          { label: 'Comes from', cell: (x) => chip(x.source || '—', 'source') },
          { label: 'Accepts', class: 'wrap', cell: (x) => (x.overridable ? h('span', { class: 'muted' }, x.accepts || '') : h('span', { class: 'muted' }, 'config file only')) },
        ], settings, { class: 'settings', testid: 'settings' }) : empty('No settings.'),
        (data.tiers || []).length ? h('div', { class: 'card' }, h('h3', null, 'Update tiers'),
          h('p', { class: 'hint' }, 'When the persona updates its files, in messages into a conversation cycle.'),
          h('p', { class: 'counts' }, data.tiers.map((t) => chip(`${t.percent}% · after ${plural(t.at, 'message')}`)))) : null);
    });
    for (const [pick, key] of [[personaPick, 'persona'], [serverPick, 'server']]) {
      pick.addEventListener('change', () => {
        if (!leaveEditor()) {
          pick.value = f[key];
          return;
        }
        f[key] = pick.value;
        load();
      });
    }
    if (!personas.length || (!overview.is_bot_admin && !servers.length)) {
      fill(content, adminHead('Settings'), empty('Nothing here you may change.'));
      return;
    }
    fill(content, adminHead('Settings', 'The cortex settings in effect and where each comes from. Type '
      + '"default" to drop an override.'),
    h('div', { class: 'bar' }, field('Persona', personaPick), serverOptions.length ? field('Server', serverPick) : null), area);
    load();
  }

  function settingControl(setting, reload) {
    const shownValue = setting.shown ?? fmtValue(setting.value);
    if (!setting.overridable) return h('span', { class: 'setting-fixed' }, shownValue);
    const input = h('input', { type: 'text', value: shownValue, 'aria-label': setting.key, title: setting.accepts || null });
    const save = button('Save', () => change('PUT', '/api/admin/settings', {
      persona: state.settingsFor.persona, server: state.settingsFor.server || null, key: setting.key, value: input.value.trim(),
    }, (answer) => (answer.note ? `Saved ${setting.key}; its name was ${answer.note}.` : `Saved ${setting.key}.`),
    reload, save), { class: 'btn btn-small', testid: `setting-${setting.key}-save`, 'aria-label': `Save ${setting.key}` });
    input.addEventListener('keydown', (event) => {
      if (event.key === 'Enter') save.click();
    });
    return h('div', { class: 'setting-value' }, input, save);
  }

  function budgetFacts(budgets) {
    const rows = [];
    const walk = (prefix, value) => {
      for (const [k, v] of Object.entries(value)) {
        if (v !== null && typeof v === 'object' && !Array.isArray(v)) walk(`${prefix}${k.replace(/_/g, ' ')}: `, v);
        else rows.push([`${prefix}${k.replace(/_/g, ' ')}`, typeof v === 'number' ? fmtInt(v) : fmtValue(v)]);
      }
    };
    walk('', budgets);
    return h('dl', { class: 'facts' }, rows.map(([k, v]) => [h('dt', null, k), h('dd', null, v)]));
  }

  function adminSpending(content) {
    section(content, 'the token spending', async (stale) => {
      const data = await api('GET', '/api/admin/budgets');
      if (stale()) return;
      const days = (data.days || []).slice().sort((a, b) => String(a.date).localeCompare(String(b.date)));
      const budgets = data.budgets || {};
      const cortex = budgets.cortex || {};
      const daily = Number(cortex.bot_daily_token_budget) || 0;
      const spent = Number(budgets.cortex_spent_today) || 0;
      const purposes = [...new Set(days.flatMap((d) => Object.keys(d.by_purpose || {})))].sort();
      fill(content, adminHead('Token spending', 'Tokens sent to and received from the language model per day (UTC), by purpose.'),
        daily ? h('div', { class: 'card today' }, h('h3', null, 'Cortex updates today'),
          h('meter', { min: '0', max: String(daily), value: String(Math.min(spent, daily)), high: String(daily * 0.8), optimum: '0', 'aria-label': 'Cortex tokens today' }),
          h('p', { class: 'meta' }, `${fmtInt(spent)} of ${fmtInt(daily)} tokens (${Math.round((spent / daily) * 100)}%) of the bot-wide daily budget`)) : null,
        h('div', { class: 'card' }, h('h3', null, `The last ${plural(days.length, 'day')}`), h('div', { class: 'chart-scroll' }, spendingChart(days, purposes)),
          h('ul', { class: 'legend-list' }, purposes.map((p, i) => h('li', null, h('span', { class: `swatch purpose-${i % 6}` }), p)))),
        days.length ? table([
          { label: 'Day (UTC)', cell: (d) => d.date },
          { label: 'Calls', class: 'num', cell: (d) => fmtInt(d.calls) },
          { label: 'Input', class: 'num', cell: (d) => fmtInt(d.input) },
          { label: 'Output', class: 'num', cell: (d) => fmtInt(d.output) },
          { label: 'By purpose', class: 'wrap', cell: (d) => Object.entries(d.by_purpose || {}).map(([p, v]) =>
            h('span', { class: 'purpose' }, h('strong', null, p), ` ${fmtInt(v.input)} in · ${fmtInt(v.output)} out · ${plural(v.calls, 'call')}`)) },
        ], days.slice().reverse(), { class: 'spending', testid: 'spending' }) : null,
        Object.keys(budgets).length ? h('div', { class: 'card' }, h('h3', null, 'Budgets'), budgetFacts(budgets)) : null);
    });
  }

  function spendingChart(days, purposes) {
    const totals = days.map((d) => (d.input || 0) + (d.output || 0));
    if (!days.length || !totals.some(Boolean)) return empty('No model calls in these days.');
    const W = 760;
    const H = 220;
    const m = { left: 64, right: 12, top: 12, bottom: 30 };
    const top = niceMax(Math.max(...totals) * 1.05);
    const slot = (W - m.left - m.right) / days.length;
    const barW = Math.max(2, Math.min(34, slot * 0.66));
    const y = (v) => H - m.bottom - (v / top) * (H - m.top - m.bottom);
    const r2 = (v) => Math.round(v * 10) / 10;
    const parts = [];
    for (let k = 0; k <= 4; k++) {
      const v = (top / 4) * k;
      parts.push(s('line', { class: 'grid', x1: m.left, x2: W - m.right, y1: r2(y(v)), y2: r2(y(v)) }),
        s('text', { class: 'tick', x: m.left - 8, y: r2(y(v)) + 4, 'text-anchor': 'end' }, fmtInt(v)));
    }
    const every = Math.ceil(days.length / 10);
    days.forEach((d, i) => {
      const cx = m.left + slot * i + slot / 2;
      let base = 0;
      const stack = purposes.map((p, j) => {
        const use = (d.by_purpose || {})[p];
        const amount = use ? (use.input || 0) + (use.output || 0) : 0;
        if (!amount) return null;
        const rect = s('rect', { class: `purpose-${j % 6}`, x: r2(cx - barW / 2), y: r2(y(base + amount)), width: r2(barW), height: r2(y(base) - y(base + amount)) },
          s('title', null, `${d.date} ${p}: ${fmtInt(amount)} tokens`));
        base += amount;
        return rect;
      });
      parts.push(s('g', { class: 'bar' }, stack));
      if (i % every === 0) parts.push(s('text', { class: 'tick', x: r2(cx), y: H - m.bottom + 18, 'text-anchor': 'middle' }, String(d.date).slice(5)));
    });
    return s('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'Tokens per day by purpose', testid: 'spending-chart' },
      s('line', { class: 'axis', x1: m.left, x2: W - m.right, y1: H - m.bottom, y2: H - m.bottom }), parts);
  }

  function adminJobs(content) {
    const picker = select([['', 'all'], ...JOB_STATUSES.map((x) => [x, x])], state.jobStatus, { testid: 'jobs-status' });
    const area = h('div');
    const pages = []; // the "before" of each page shown so far (the first: none)
    const load = () => section(area, 'the job queue', async (stale) => {
      const params = new URLSearchParams();
      if (state.jobStatus) params.set('status', state.jobStatus);
      if (pages.length) params.set('before', String(pages[pages.length - 1]));
      const q = params.toString() ? `?${params}` : '';
      const data = await api('GET', `/api/admin/jobs${q}`);
      if (stale()) return;
      const jobs = data.jobs || [];
      const paging = h('nav', { class: 'pager', 'aria-label': 'Pages' },
        pages.length ? button('← Newer', () => { pages.pop(); load(); }, { class: 'btn btn-small', testid: 'jobs-newer' }) : null,
        data.older ? button('Older →', () => { pages.push(data.older); load(); }, { class: 'btn btn-small', testid: 'jobs-older' }) : null);
      fill(area, 
        h('p', { class: 'counts' }, Object.entries(data.counts || {}).map(([k, v]) => chip(`${k}: ${fmtInt(v)}`, k))),
        jobs.length ? table([
          { label: '#', class: 'num', cell: (j) => String(j.id) },
          { label: 'Kind', cell: (j) => j.kind },
          { label: 'Key', class: 'wrap', cell: (j) => h('code', null, j.key || '') },
          { label: 'Status', cell: (j) => chip(j.status, j.status) },
          { label: 'Tries', class: 'num', cell: (j) => (j.max_attempts ? `${j.attempts}/${j.max_attempts}` : String(j.attempts ?? '')) },
          { label: 'Last error', class: 'wrap', cell: (j) => (j.last_error ? h('span', { class: 'error-text' }, j.last_error) : '') },
          {
            label: 'When', cell: (j) => [fmtDate(j.created_at), j.status === 'queued' && toMs(j.run_after) > Date.now()
              ? h('span', { class: 'item-notes' }, `runs after ${fmtDate(j.run_after)}`) : null],
          },
          {
            label: '', class: 'row-actions', cell: (j) => (j.status === 'failed' ? button('Retry', (event) =>
              change('POST', `/api/admin/jobs/${enc(j.id)}/retry`, undefined, `Job #${j.id} will run again.`, load, event.currentTarget),
            { class: 'btn btn-small', testid: `retry-${j.id}`, 'aria-label': `Retry job #${j.id}` }) : ''),
          },
        ], jobs, { class: 'jobs', testid: 'jobs' }) : empty(state.jobStatus ? `No ${state.jobStatus} jobs.` : 'No jobs.'),
        paging);
    });
    picker.addEventListener('change', () => {
      state.jobStatus = picker.value;
      pages.length = 0;
      load();
    });
    fill(content, adminHead('Job queue', 'Background work: file updates, summaries, embeddings, upkeep. A failed job can run again.'),
      h('div', { class: 'bar' }, field('Status', picker)), area);
    load();
  }

  function adminUsers(content) {
    section(content, 'the users', async (stale) => {
      const data = await api('GET', '/api/admin/users');
      if (stale()) return;
      const users = data.users || [];
      const total = data.total ?? users.length;
      fill(content, adminHead('Users', `${plural(total, 'person')} the bot keeps something about`
        + `${total > users.length ? ` (the ${fmtInt(users.length)} seen last)` : ''}; counts only, never what they said.`),
      users.length ? table([
        { label: 'Name', cell: (u) => u.name || '—' },
        { label: 'Account', cell: (u) => h('code', null, u.key) },
        { label: 'Messages', class: 'num', cell: (u) => fmtInt(u.messages) },
        { label: 'Memory items', class: 'num', cell: (u) => fmtInt(u.items) },
        { label: 'Personas', class: 'num', cell: (u) => fmtInt(u.pairs) },
        { label: 'Last seen', cell: (u) => fmtDate(u.last_seen) },
      ], users, { class: 'users', testid: 'users' }) : empty('No users yet.'));
    });
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', boot);
  else boot();
}());
